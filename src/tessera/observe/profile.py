"""torch.profiler traces of chosen optimizer steps: ``[profile] steps = [3, 4]``.

Every rank records exactly those steps and writes ``rank<r>-step<s>.json`` (Chrome trace-event format)
into ``profile.dir`` (default ``<run_dir>/profile``) right after the step, outside the step's timer, so
``tokens_per_s`` of the other steps is unaffected. Open a file at https://ui.perfetto.dev or in Chrome's
``chrome://tracing``; the CPU activity is always recorded, plus the accelerator's kernels when the run's
device is one (``run.device = "cuda"``), chosen from the device type, so this file names no device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from tessera.errors import ConfigError


@dataclass
class ProfileConfig:
    steps: list[int] = field(default_factory=list)  # optimizer steps (1-based) to trace on every rank
    dir: str = ""  # where the traces go; empty: <run_dir>/profile

    def validate(self) -> ProfileConfig:
        bad = [s for s in self.steps if s < 1]
        if bad:
            raise ConfigError(f"profile.steps holds {bad[0]}; steps are counted from 1")
        return self

    def check_steps(self, train_steps: int) -> None:
        """Every chosen step is one the run takes; ``dir`` without steps would write nothing."""
        late = [s for s in self.steps if s > train_steps]
        if late:
            raise ConfigError(f"profile.steps holds {late[0]} but the run takes train.steps={train_steps} "
                              f"steps; choose steps from 1 to {train_steps}")
        if self.dir and not self.steps:
            raise ConfigError(f"profile.dir={self.dir!r} has no effect without profile.steps; "
                              f"give the steps to trace, e.g. --profile.steps=[3]")


def activities(device: torch.device) -> list[ProfilerActivity]:
    """CPU always; the accelerator's own activity (CUDA, XPU, …) when the device is one the profiler knows."""
    out = [ProfilerActivity.CPU]
    extra = getattr(ProfilerActivity, device.type.upper(), None) if device.type != "cpu" else None
    return out + ([extra] if extra is not None else [])


class StepProfiler:
    """``with profiler.step(n): ...`` traces step ``n`` when it is chosen, else does nothing."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device):
        self.steps = set(cfg.steps)
        self.folder = Path(cfg.dir) if cfg.dir else Path(run_dir) / "profile"
        self.rank, self.device = rank, device
        self.written: list[Path] = []

    def path(self, step: int) -> Path:
        return self.folder / f"rank{self.rank}-step{step}.json"

    @contextlib.contextmanager
    def step(self, step: int):
        if step not in self.steps:
            yield
            return
        with torch.profiler.profile(activities=activities(self.device), record_shapes=True) as prof:
            with torch.profiler.record_function(f"tessera step {step}"):
                yield
        self.folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path(step)))
        self.written.append(self.path(step))
