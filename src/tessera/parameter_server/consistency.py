"""The consistency bookkeeping every parameter server shares: worker clocks, the update version, staleness.

One implementation serves the CTR job's RPC servers (``parameter_server.server``) and the transformer's
servers hosted inside the training ranks (``train.dp_modes.ps_async``). All state is guarded by one
condition variable, ``cond``; every method below expects the caller to hold it.

- ``clock[w]``: steps worker w has pushed (so "worker w finished step t" is ``clock[w] >= t + 1``).
- ``version``: updates applied on this server. A push computed on parameters pulled at version v and
  applied when the server is at version V has staleness V - v (updates it did not see).
- SSP gate with bound s: a worker may start step t only once every worker finished step t - s - 1,
  i.e. ``t - min(clock) <= s``; the largest ``t - min(clock)`` a start proceeded with is ``max_gap``.
Every wait is bounded by ``timeout`` seconds and ends in a :class:`PSError` naming who waited for what.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

from tessera.parameter_server.errors import PSError


class StalenessClock:
    def __init__(self, name: str, workers: int, bound: int | None, timeout: float):
        self.name, self.bound, self.timeout = name, bound, timeout  # bound None: no gate (bsp / async)
        self.cond = threading.Condition()
        self.clock = [0] * workers
        self.version = 0
        self.staleness = collections.Counter()  # staleness of every applied update -> count
        self.max_gap = 0

    def wait(self, ready: Callable[[], bool], what: str) -> None:
        if not self.cond.wait_for(ready, timeout=self.timeout):
            raise PSError(f"parameter server {self.name} gave up after {self.timeout:g} s waiting for {what} "
                          f"(worker clocks {self.clock}): a worker died or hung")

    def gate(self, worker: int, step: int) -> None:
        """Block until worker ``worker`` may start step ``step`` (SSP), then record the gap it starts with."""
        if self.bound is not None:
            self.wait(lambda: step - min(self.clock) <= self.bound,
                      f"worker {worker} waited for the slowest worker to finish step {step - self.bound - 1}")
        self.max_gap = max(self.max_gap, step - min(self.clock))

    def record(self, read_version: int) -> None:
        """An update computed at ``read_version`` is about to be applied (the version then advances)."""
        self.staleness[self.version - read_version] += 1

    def tick(self, worker: int, step: int, notify: bool = True) -> None:
        """Worker ``worker`` finished step ``step``."""
        self.clock[worker] = step + 1
        if notify:
            self.cond.notify_all()
