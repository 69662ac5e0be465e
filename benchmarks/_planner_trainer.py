"""Measurements for the planner's validation table through tessera's Trainer (pipeline schedules, context
and expert parallelism, ZeRO offload): the layouts the strategy modules alone do not compose.

Each rank builds a Trainer from ``--section.key=value`` overrides, runs a few optimizer steps and reports
model-state bytes (the trainer's MemoryLedger), the peak bytes saved for backward (live at once: a 1F1B
stage frees a micro-batch's activations after its backward, so summing every saved storage of the step
would count micro-batches that are never in flight together), the comm ledger's payload bytes per step
by axis, and the fastest step time.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import weakref

import torch

from tessera.train.config import load_config, validate_config
from tessera.train.memory import storage_key

CPU = torch.device("cpu")


class PeakSaved:
    """Peak bytes of distinct storages saved for backward that are alive at the same time.

    Each saved tensor is held weakly; a storage counts while any tensor saved from it is alive (autograd
    drops its saved tensors once a node's backward has run). Parameters (``exclude()`` → storage keys,
    evaluated at every save so that ZeRO-3's per-use gathered weights are recognised) never count."""

    def __init__(self, exclude):
        self.exclude = exclude
        self.live: dict[tuple, tuple[int, list]] = {}
        self.peak = 0

    def _current(self) -> int:
        total = 0
        for key in list(self.live):
            size, refs = self.live[key]
            refs[:] = [r for r in refs if r() is not None]
            if refs:
                total += size
            else:
                del self.live[key]
        return total

    @contextlib.contextmanager
    def track(self):
        params = self.exclude()

        def pack(t: torch.Tensor):
            key = storage_key(t)
            if key not in params and key not in self.exclude():
                size, refs = self.live.setdefault(key, (t.untyped_storage().nbytes(), []))
                refs.append(weakref.ref(t))
                self.peak = max(self.peak, self._current())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


def _param_keys(trainer):
    keys = {storage_key(p) for p in trainer.core.parameters()}
    if trainer.engine is not None:
        keys |= {storage_key(t) for t in trainer.engine.memory_tensors()["params"] if t is not None}
    return keys


def measure_trainer(rank: int, world_size: int, overrides: list[str], steps: int) -> dict:
    """Train ``steps`` + 2 steps (2 warm-up) of the job ``overrides`` describe on this rank."""
    from tessera.train.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        # the pipeline's timeline is a [pipeline] key: set only where there is a pipeline (a setting
        # without effect is refused)
        timeline = ["pipeline.timeline=false"] if any(o.startswith("parallel.pp=") for o in overrides) else []
        cfg = load_config(None, ["--" + o for o in [*overrides, f"run.out_dir={out}", "run.progress=false",
                                 "checkpoint.save_final=false", *timeline,
                                 f"train.steps={steps + 2}", "optim.grad_clip=0"]])
        validate_config(cfg, world_size)
        trainer = Trainer(cfg, CPU)
        try:
            peak = PeakSaved(lambda: _param_keys(trainer))
            trainer.memory.track_activations = peak.track  # the trainer's tracker hook, counted at its peak
            times, start = [], None
            for step in range(steps + 2):
                if step == 2:
                    start = trainer.ledger.stats()
                blocked0 = sum(v.seconds for v in trainer.ledger.stats().values())
                c0 = time.thread_time()
                _, _, seconds = trainer._train_step(track=step == 0 or step == steps + 1)
                if step >= 2:
                    times.append((seconds, sum(v.seconds for v in trainer.ledger.stats().values()) - blocked0,
                                  time.thread_time() - c0))
            comm = {}
            for (axis, op), v in trainer.ledger.stats().items():
                b0 = start[(axis, op)].bytes if (axis, op) in start else 0
                c0 = start[(axis, op)].count if (axis, op) in start else 0
                a = comm.setdefault(axis, {"bytes": 0.0, "calls": 0.0, "ops": {}})
                a["bytes"] += (v.bytes - b0) / steps
                a["calls"] += (v.count - c0) / steps
                a["ops"][op] = (v.bytes - b0) / steps
            mem = trainer.last_memory.as_dict()
            return {"memory": mem, "activations": peak.peak, "comm": comm, "step_s": min(times)[0],
                    "blocked_s": min(times)[1], "cpu_s": min(t[2] for t in times), "steps_s": times}
        finally:
            trainer.close()
