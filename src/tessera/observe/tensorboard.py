"""TensorBoard event files beside ``metrics.jsonl`` (``run.tensorboard = true``; rank 0 writes them).

Every number of every metrics line becomes a scalar against the optimizer step, under the tag its
line names it by: ``loss``, ``lr``, ``tokens_per_s``, ``grad_norm``, ``flops_per_s``, ``mfu``, ``time_*``,
``val_loss``; ``memory/rank<r>/<field>`` for each rank's memory snapshot and
``comm_bytes/<axis>/<op>`` for the bytes moved per step by each axis and collective.

The package is optional (the ``tensorboard`` extra): ``check_available`` refuses the setting before
launch when it is missing, and only this module imports it, when a run asks for it.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from tessera.errors import ConfigError

FOLDER = "tensorboard"  # inside the run folder


def check_available() -> None:
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("run.tensorboard needs the tensorboard package: pip install 'tessera[tensorboard]' "
                          "(or set run.tensorboard=false)")


def scalars(record: dict) -> dict[str, float]:
    """A metrics line's numbers as ``{tag: value}``; nulls, strings, lists of steps and counters other
    than bytes are left out."""
    out = {}
    for key, value in record.items():
        if key in ("kind", "step") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
        elif key == "memory" and isinstance(value, list):  # one dict per rank: {"rank": r, field: bytes}
            for row in value:
                out.update({f"memory/rank{row['rank']}/{k}": float(v) for k, v in row.items()
                            if k != "rank" and isinstance(v, (int, float))})
        elif key == "comm_per_step" and isinstance(value, dict):  # {"axis/op": {"bytes", ...}}
            out.update({f"comm_bytes/{name}": float(stat["bytes"]) for name, stat in value.items()})
    return out


class TensorBoardWriter:
    """Scalars of metrics lines into ``<run_dir>/tensorboard``. The first line a process logs sets
    ``purge_step``: a run resumed from a checkpoint at step s logs nothing before step s + 1 (or s, its
    first validation), so the events a failed attempt wrote from there on are dropped when read, and
    the resumed run's take their place instead of doubling them."""

    def __init__(self, run_dir: Path):
        self.folder = run_dir / FOLDER
        self._writer = None

    def log(self, record: dict) -> None:
        step = int(record.get("step", 0))
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.folder), purge_step=step)
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()  # as metrics.jsonl: a killed run keeps every line written so far

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
