"""Run outputs on rank 0: ``metrics.jsonl`` (one JSON object per line), ``summary.json`` and the plots.

Each line has ``kind`` "train" (step, loss, lr, tokens_per_s, flops_per_s and mfu (tessera.observe.mfu),
grad_norm, comm per step by axis/op, memory per rank) or "eval" (step, val_loss). With ``tensorboard``
the same numbers also go to TensorBoard event files (tessera.observe.tensorboard).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tessera.observe.tensorboard import TensorBoardWriter


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = False):
        self.run_dir = run_dir
        self.tensorboard = TensorBoardWriter(run_dir) if tensorboard else None
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self.train: list[dict] = []
        self.evals: list[dict] = []

    def truncate_after(self, step: int) -> None:
        """Keep only the records up to ``step`` (a run resumed from a checkpoint at ``step`` repeats
        what the failed attempt logged after it) and continue appending."""
        self._file.close()
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by the failure
                continue
            if record.get("step", 0) <= step:
                kept.append(record)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self.train = [r for r in kept if r.get("kind") != "eval"]
        self.evals = [r for r in kept if r.get("kind") == "eval"]
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a killed run keeps every line written so far
        (self.evals if record.get("kind") == "eval" else self.train).append(record)
        if self.tensorboard is not None:
            self.tensorboard.log(record)

    def close(self) -> None:
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def write_summary(self, summary: dict) -> Path:
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        return path

    def plot_loss(self, title: str) -> Path:
        """Training loss per logged interval and validation loss against the optimizer step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        if self.train:
            ax.plot([r["step"] for r in self.train], [r["loss"] for r in self.train], label="train loss")
        if self.evals:
            ax.plot([r["step"] for r in self.evals], [r["val_loss"] for r in self.evals], "o-",
                    label="validation loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats per byte)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        path = self.run_dir / "loss.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def finite(x: float) -> float | None:
    """JSON has no NaN or infinity: write null instead."""
    return x if math.isfinite(x) else None
