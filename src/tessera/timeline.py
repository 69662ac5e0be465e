"""Timeline: the start and end of every compute and communication action on every rank, one of the three
instruments (with the CommLedger and the MemoryLedger) by which a run shows what it did.

Any strategy records spans (``with timeline.span("F0.3", "compute"):`` or ``timeline.add(...)``);
:func:`gather` brings every rank's events to all ranks; :func:`write_chrome_trace` writes Chrome-trace JSON
(opens in Perfetto / chrome://tracing); :func:`write_gantt_png` draws a Gantt chart with matplotlib; and
:func:`bubble_fraction` measures idle time: 1 - (compute time summed over ranks) / (ranks x wall window).

Times come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every process of a machine;
ranks on different machines would need their offsets aligned first).
"""

from __future__ import annotations

import contextlib
import json
import pickle
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Event:
    name: str  # e.g. "F s1 mb3"
    cat: str  # "compute" or "comm" (or any label a strategy chooses)
    rank: int
    start: float  # seconds (perf_counter)
    end: float


class Timeline:
    """Events of one rank. ``enabled=False`` makes every call a no-op."""

    def __init__(self, rank: int = 0, enabled: bool = True):
        self.rank, self.enabled = rank, enabled
        self.events: list[Event] = []

    def add(self, name: str, cat: str, start: float, end: float) -> None:
        if self.enabled:
            self.events.append(Event(name, cat, self.rank, start, end))

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute"):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter())

    def clear(self) -> None:
        self.events = []


def gather(timeline: Timeline, group) -> list[Event]:
    """Every rank's events of ``group`` (a tessera CommGroup), on every rank: pickled, padded to the
    longest rank's bytes, gathered on the group's device (NCCL needs the accelerator), unpickled on the host."""
    from tessera import comm  # the timeline itself stays usable without a process group

    if group.size == 1:
        return list(timeline.events)
    blob = torch.frombuffer(bytearray(pickle.dumps(timeline.events)), dtype=torch.uint8)
    sizes = torch.zeros(group.size, dtype=torch.int64, device=group.device)  # [N] bytes per rank
    comm.all_gather(sizes, torch.tensor([blob.numel()], dtype=torch.int64, device=group.device), group)
    sizes = sizes.tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=group.device)
    padded[: blob.numel()] = blob.to(group.device)
    out = torch.zeros(group.size * padded.numel(), dtype=torch.uint8, device=group.device)  # [N * max]
    comm.all_gather(out, padded, group)
    events: list[Event] = []
    for r, chunk in enumerate(out.view(group.size, -1).cpu()):
        events += pickle.loads(chunk[: sizes[r]].numpy().tobytes())
    return events


def bubble_fraction(events: list[Event], n_ranks: int | None = None, cat: str = "compute",
                    window: tuple[float, float] | None = None) -> tuple[float, list[float]]:
    """(overall idle fraction, idle fraction per rank) of the ``cat`` spans over the common wall window
    (first start to last end over all ranks unless given). Overlapping spans on a rank count once."""
    spans = [e for e in events if e.cat == cat]
    if not spans:
        return 0.0, []
    ranks = sorted({e.rank for e in events})
    n_ranks = n_ranks or (max(ranks) + 1)
    t0, t1 = window or (min(e.start for e in spans), max(e.end for e in spans))
    width = t1 - t0
    per_rank = []
    for r in range(n_ranks):
        busy, cur_s, cur_e = 0.0, None, None
        for e in sorted((e for e in spans if e.rank == r), key=lambda e: e.start):
            s, t = max(e.start, t0), min(e.end, t1)
            if t <= s:
                continue  # outside the window
            if cur_e is None or s > cur_e:
                busy += (cur_e - cur_s) if cur_e is not None else 0.0
                cur_s, cur_e = s, t
            else:
                cur_e = max(cur_e, t)
        busy += (cur_e - cur_s) if cur_e is not None else 0.0
        per_rank.append(1.0 - busy / width if width > 0 else 0.0)
    return sum(per_rank) / n_ranks, per_rank


def chrome_trace(events: list[Event]) -> dict:
    """Chrome-trace JSON: one complete ("X") event per span, pid 0, one thread per rank, times in us."""
    t0 = min((e.start for e in events), default=0.0)
    trace = [{"name": e.name, "cat": e.cat, "ph": "X", "pid": 0, "tid": e.rank,
              "ts": (e.start - t0) * 1e6, "dur": (e.end - e.start) * 1e6} for e in events]
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
             for r in sorted({e.rank for e in events})]
    return {"traceEvents": names + trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, events: list[Event]) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events), f)


_COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#c44e52", "comm": "#bbbbbb"}


def write_gantt_png(path: str, events: list[Event], title: str = "", bubble: float | None = None) -> None:
    """One row per rank; compute spans coloured by the first letter of their name (F/B/W), comm in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((e.start for e in events), default=0.0)
    ranks = sorted({e.rank for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.5))
    for e in events:
        color = _COLORS["comm"] if e.cat != "compute" else _COLORS.get(e.name[:1], "#8172b2")
        y, h = (e.rank - 0.4, 0.8) if e.cat == "compute" else (e.rank + 0.3, 0.15)
        ax.broken_barh([((e.start - t0) * 1e3, (e.end - e.start) * 1e3)], (y, h), facecolors=color,
                       edgecolors="white", linewidth=0.3)
        if e.cat == "compute" and len(ranks) * len(events) < 4000:
            ax.text((e.start - t0 + (e.end - e.start) / 2) * 1e3, e.rank, e.name.split()[-1] if " " in e.name
                    else e.name, ha="center", va="center", fontsize=5, color="white")
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    label = title + (f"  bubble {bubble:.3f}" if bubble is not None else "")
    ax.set_title(label.strip())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
