"""What a run folder holds, read for the report: config, summary, metrics lines and pipeline timeline.

Only a missing folder or a missing ``metrics.jsonl`` is an error (one sentence, :class:`UserError`);
every other file is optional, because a killed run, a dense run or an older run lacks some of them.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tessera.errors import UserError
from tessera.timeline import Event


@dataclass
class RunRecords:
    folder: Path
    config: dict = field(default_factory=dict)  # config.toml as TOML tables ({} when absent)
    summary: dict = field(default_factory=dict)  # summary.json ({} when absent: the run did not finish)
    train: list[dict] = field(default_factory=list)  # metrics.jsonl lines of kind "train"
    evals: list[dict] = field(default_factory=list)  # metrics.jsonl lines of kind "eval"
    timeline: list[Event] = field(default_factory=list)  # the pipeline's last step, every rank ([] if none)
    notes: list[str] = field(default_factory=list)  # files present but unreadable, said on the page


def read_run(folder: str | Path) -> RunRecords:
    """Everything the report draws from ``folder``; raises UserError when there is nothing to draw."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"run folder {folder} does not exist (give a folder a run wrote, e.g. runs/<name>)")
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{folder} has no metrics.jsonl, so it is not a run folder tessera wrote")
    run = RunRecords(folder)
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short when a run was killed
            continue
        if isinstance(record, dict):
            (run.evals if record.get("kind") == "eval" else run.train).append(record)
    run.config = _read(folder / "config.toml", lambda text: tomllib.loads(text), run.notes, {})
    run.summary = _read(folder / "summary.json", json.loads, run.notes, {})
    run.timeline = _read(folder / "trace.json", lambda text: trace_events(json.loads(text)), run.notes, [])
    return run


def _read(path: Path, parse, notes: list[str], empty):
    """``parse(text of path)``, or ``empty`` when the file is absent or cannot be parsed (noted)."""
    if not path.is_file():
        return empty
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (ValueError, KeyError, TypeError) as err:
        notes.append(f"{path.name} could not be read ({err}); its part is left out.")
        return empty


def trace_events(trace: dict) -> list[Event]:
    """Timeline events back from the Chrome trace :func:`tessera.timeline.chrome_trace` wrote: one complete
    ("X") event per span, the rank as its thread id, times in microseconds from the first start."""
    return [Event(e["name"], e.get("cat", "compute"), int(e["tid"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
            for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
