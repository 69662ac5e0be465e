"""Each optimizer step's wall-clock split (DeepSpeed's ``wall_clock_breakdown``): ``train.time_breakdown``.

A step's time is split into disjoint parts, so they sum to at most the step's time (the rest is batch
assembly, the memory snapshot of a logged step, ``zero_grad``):

    forward    model and loss of every micro-batch, minus the communication waited on inside them
    backward   ``loss.backward()`` of every micro-batch, minus the communication waited on inside it
    optimizer  unscale, clip, ``step`` and the learning-rate schedule, minus communication waits
    comm_wait  every second a collective of this rank blocked it during the step, wherever it happened

Communication wait is what tessera's collectives already measure (``tessera.comm.CommLedger``: the blocked
time of each call, an async one's launch plus its ``wait``); overlapped communication is not waiting.
A pipeline schedule interleaves forwards and backwards of different micro-batches, so a pipeline step
reports ``forward_backward`` (both together) in place of ``forward`` and ``backward``.
Each boundary synchronises the device (a no-op on the CPU), which is why the split is opt-in.
"""

from __future__ import annotations

import contextlib
import time

import torch

from tessera.comm.ledger import CommLedger
from tessera.device import synchronize


class StepTimer:
    """Phases of the current step: ``with timer.phase("forward"): ...``; ``take()`` ends the step."""

    def __init__(self, device: torch.device, ledger: CommLedger, enabled: bool):
        self.device, self.ledger, self.enabled = device, ledger, enabled
        self.seconds: dict[str, float] = {}
        self.comm_start = 0.0

    def _comm_seconds(self) -> float:
        return self.ledger.total().seconds

    def start(self) -> None:
        self.seconds, self.comm_start = {}, self._comm_seconds() if self.enabled else 0.0

    def phase(self, name: str):
        return self._timed(name) if self.enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _timed(self, name: str):
        synchronize(self.device)
        t0, c0 = time.perf_counter(), self._comm_seconds()
        yield
        synchronize(self.device)
        wall, waited = time.perf_counter() - t0, self._comm_seconds() - c0
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, wall - waited)

    def take(self) -> dict[str, float]:
        """This step's seconds per part (empty when the split is off)."""
        if not self.enabled:
            return {}
        return {**self.seconds, "comm_wait": max(0.0, self._comm_seconds() - self.comm_start)}


def add_split(total: dict[str, float], step: dict[str, float]) -> None:
    """Accumulate one step's split into an interval's sums."""
    for key, value in step.items():
        total[key] = total.get(key, 0.0) + value


def split_fields(total: dict[str, float], steps: int) -> dict[str, float]:
    """An interval's sums as metrics fields: ``time_<part>`` in seconds per step."""
    return {f"time_{key}": value / steps for key, value in sorted(total.items())} if steps else {}
