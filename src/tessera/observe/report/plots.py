"""The report's plots, each drawn with matplotlib (Agg) and returned as base64 PNG text, or None when the
run has no data for it (the page then says so in a sentence).

Inputs are metrics.jsonl lines (``kind`` "train" / "eval", see tessera.train.metrics) and timeline events.
"""

from __future__ import annotations

import base64
import io

from tessera.timeline import Event, write_gantt_png

MIB = 2**20
MEMORY_PARTS = ("params", "grads", "optimizer", "activations")  # MemorySnapshot's counted bytes


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _encode(fig) -> str:
    """The figure as base64 PNG text (for ``<img src="data:image/png;base64,...">``); closes it."""
    plt = _pyplot()
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _series(records: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of the records that carry a number under ``key`` (null values are skipped)."""
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and "step" in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


def loss_plot(train: list[dict], evals: list[dict]) -> str | None:
    """Train loss (per logged interval) and validation loss against the optimizer step."""
    lines = [(label, *_series(records, key), style) for label, records, key, style in
             (("train loss", train, "loss", "-"), ("validation loss", evals, "val_loss", "o-"))]
    lines = [line for line in lines if line[1]]
    if not lines:
        return None
    fig, ax = _pyplot().subplots(figsize=(7, 3.5))
    for label, steps, values, style in lines:
        ax.plot(steps, values, style, label=label)
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _encode(fig)


def throughput_plot(train: list[dict]) -> str | None:
    """Tokens per second (whole job, per logged interval) against the step."""
    steps, values = _series(train, "tokens_per_s")
    if not steps:
        return None
    fig, ax = _pyplot().subplots(figsize=(7, 3.5))
    ax.plot(steps, values, "o-")
    ax.set(xlabel="optimizer step", ylabel="tokens / s")
    ax.grid(alpha=0.3)
    return _encode(fig)


def flops_plot(train: list[dict]) -> str | None:
    """One rank's achieved model FLOP/s (tessera.observe.mfu) and, where the peak is known, MFU on a second
    axis, against the step."""
    steps, values = _series(train, "flops_per_s")
    if not steps:
        return None
    fig, ax = _pyplot().subplots(figsize=(7, 3.5))
    ax.plot(steps, [v / 1e9 for v in values], "o-", label="GFLOP/s per rank")
    ax.set(xlabel="optimizer step", ylabel="model GFLOP/s per rank")
    ax.grid(alpha=0.3)
    mfu_steps, mfu = _series(train, "mfu")
    if mfu_steps:
        twin = ax.twinx()
        twin.plot(mfu_steps, [100 * m for m in mfu], "s--", color="#c44e52")
        twin.set_ylabel("MFU (%)")
    return _encode(fig)


def memory_plot(train: list[dict]) -> str | None:
    """The last line's memory per rank: counted bytes stacked by part (left), peak resident set (right)."""
    per_rank = next((r["memory"] for r in reversed(train) if r.get("memory")), None)
    if not per_rank:
        return None
    plt = _pyplot()
    ranks = [m.get("rank", i) for i, m in enumerate(per_rank)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    bottom = [0.0] * len(per_rank)
    for part in MEMORY_PARTS:
        mib = [m.get(part, 0) / MIB for m in per_rank]
        left.bar(ranks, mib, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, mib)]
    left.set(xlabel="rank", ylabel="MiB", title="counted tensors")
    left.legend(fontsize=8)
    right.bar(ranks, [m.get("peak_rss", 0) / MIB for m in per_rank], color="#8172b2")
    right.set(xlabel="rank", ylabel="MiB", title="peak resident memory")
    for ax in (left, right):
        ax.set_xticks(ranks)
    return _encode(fig)


def comm_plot(train: list[dict]) -> str | None:
    """Bytes per step of every ``axis/op`` the run's collectives used, against the step (log scale)."""
    keys = sorted({k for r in train for k in (r.get("comm_per_step") or {})})
    if not keys:
        return None
    fig, ax = _pyplot().subplots(figsize=(7, 3.5))
    for key in keys:
        rows = [(r["step"], r["comm_per_step"][key].get("bytes", 0)) for r in train
                if key in (r.get("comm_per_step") or {})]
        ax.plot([s for s, _ in rows], [max(b, 1) for _, b in rows], "o-", label=key)
    ax.set(xlabel="optimizer step", ylabel="bytes per step (rank 0)", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _encode(fig)


def time_split_plot(train: list[dict]) -> str | None:
    """Seconds per step spent in each ``time_<part>`` of train.time_breakdown, stacked against the step."""
    parts = sorted({k for r in train for k in r if k.startswith("time_")})
    rows = [r for r in train if any(isinstance(r.get(p), (int, float)) for p in parts)]
    if not parts or not rows:
        return None
    fig, ax = _pyplot().subplots(figsize=(7, 3.5))
    steps = [r["step"] for r in rows]
    ax.stackplot(steps, *[[r.get(p) or 0.0 for r in rows] for p in parts], labels=[p[5:] for p in parts])
    ax.set(xlabel="optimizer step", ylabel="seconds per step")
    ax.legend(fontsize=8)
    return _encode(fig)


def timeline_plot(events: list[Event], bubble: float | None) -> str | None:
    """The pipeline's last step as a Gantt chart, one row per stage rank (tessera.timeline draws it)."""
    if not events:
        return None
    buffer = io.BytesIO()
    write_gantt_png(buffer, events, "pipeline, last step", bubble)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
