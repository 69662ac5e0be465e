"""One parameter server: a hash partition of every sparse table, some whole dense tensors, an optimizer.

Sparse table rows are partitioned by ``row % S`` (rows are already hashed feature ids, so this spreads
popular and rare features evenly); server s stores global row r at local row ``r // S``. Each dense
tensor lives whole, flattened to one row ``[1, numel]``, on server ``i % S`` (i its index in a fixed
order). Workers call ``pull`` and ``push`` over RPC (see :func:`serve_call`); the consistency model
decides when a push is applied and when a pull may proceed:

- bsp: pushes of step t are buffered until all W workers pushed, summed in worker order (each worker
  already divided by the global batch, so the sum is the global mean gradient) and applied once; every
  push returns after that update, so the next pull sees it (staleness 0).
- asp: each push is applied at once; its staleness is the number of updates applied on this server
  between the worker's pull and its push.
- ssp: as asp, but a pull for step t waits until every worker finished step t - s - 1, so no worker is
  more than s steps ahead of the slowest. The largest gap seen at a pull is recorded (the bound test).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tessera.errors import ConfigError
from tessera.models.ctr import SPARSE_TABLES
from tessera.parameter_server.config import PSConfig
from tessera.parameter_server.consistency import StalenessClock
from tessera.parameter_server.errors import PSError
from tessera.parameter_server.row_optim import RowOptimizer

_SERVERS: dict[str, "ParameterServer"] = {}  # the server objects this process hosts, by RPC name
# what a worker may ask of a server (the RPC surface below); everything else (loading a folder, saving,
# the internals, any dunder) is refused before it is looked up
RPC_METHODS = frozenset({"pull", "push", "start_step", "final_state"})


def serve_call(name: str, method: str, *args):
    """The one function workers invoke over RPC: ``_SERVERS[name].method(*args)``, for a method of
    :data:`RPC_METHODS` only."""
    if not (isinstance(method, str) and method in RPC_METHODS):
        raise PSError(f"parameter server {name} refused the RPC method {str(method)[:60]!r}: workers may "
                      f"call only {', '.join(sorted(RPC_METHODS))}")
    server = _SERVERS.get(name) if isinstance(name, str) else None
    if server is None:
        raise PSError(f"no parameter server named {str(name)[:60]!r} runs in this process")
    return getattr(server, method)(*args)


def register(server: "ParameterServer") -> None:
    _SERVERS[server.name] = server


def dense_owner(i: int, servers: int) -> int:
    return i % servers


class ParameterServer:
    def __init__(self, index: int, cfg: PSConfig, init_state: dict[str, torch.Tensor], dense: list[str],
                 ckpt_dir: str = ""):
        self.index, self.name, self.cfg = index, f"ps{index}", cfg
        self.S, self.W = cfg.servers, cfg.workers
        self.ckpt_dir = ckpt_dir
        self.tables: dict[str, torch.Tensor] = {}
        for name in SPARSE_TABLES:  # [ceil((R - s) / S), C]: global rows s, s + S, s + 2S, ...
            self.tables[name] = init_state[name].detach()[index::self.S].clone()
        for i, name in enumerate(dense):
            if dense_owner(i, self.S) == index:
                self.tables[name] = init_state[name].detach().reshape(1, -1).clone()
        self.opts = {n: RowOptimizer(cfg.optimizer, t, cfg.lr, dense=n not in SPARSE_TABLES)
                     for n, t in self.tables.items()}
        # worker clocks, version, staleness histogram and the SSP gate: shared with the transformer's servers
        self.sync = StalenessClock(self.name, self.W, cfg.staleness if cfg.mode == "ssp" else None, cfg.timeout)
        self.cond = self.sync.cond
        self.pending: dict[int, dict] = {}  # bsp: worker -> its push for the current step
        self.saved_step = -1
        if cfg.resume:
            self.load(cfg.resume)

    # ---- the RPC surface ---------------------------------------------------------------------------

    def pull(self, worker: int, step: int, request: dict[str, torch.Tensor]):
        """``request`` table -> local row ids; returns (table -> rows [U, C], this server's version)."""
        with self.cond:
            self.sync.gate(worker, step)
            return {n: self.tables[n][ids].clone() for n, ids in request.items()}, self.sync.version

    def push(self, worker: int, step: int, grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
             read_version: int) -> None:
        """``grads`` table -> (local row ids [U], gradient rows [U, C]) computed on ``read_version``."""
        with self.cond:
            if self.cfg.mode != "bsp":
                self.sync.record(read_version)
                self._apply([grads])
                self._tick(worker, step)
                return
            self.pending[worker] = grads
            self._tick(worker, step, notify=False)
            if len(self.pending) == self.W:
                self.sync.staleness[0] += self.W
                self._apply([self.pending[w] for w in sorted(self.pending)])
                self.pending.clear()
                self.cond.notify_all()
                self._maybe_save()
            else:
                self.sync.wait(lambda: self.sync.version > read_version,
                           f"worker {worker} waited for every worker's push of step {step}")

    def start_step(self) -> int:
        return min(self.sync.clock)

    def final_state(self, steps: int):
        """After every worker pushed ``steps`` steps: (tables, staleness histogram, max gap, version)."""
        with self.cond:
            self.sync.wait(lambda: min(self.sync.clock) >= steps, f"every worker to finish step {steps - 1}")
            if self.ckpt_dir and self.saved_step != steps:
                self.save(self.ckpt_dir, steps)
            return ({n: t.clone() for n, t in self.tables.items()}, dict(self.sync.staleness), self.sync.max_gap,
                    self.sync.version)

    # ---- internals ---------------------------------------------------------------------------------

    def _tick(self, worker: int, step: int, notify: bool = True) -> None:
        self.sync.tick(worker, step, notify)
        if notify:
            self._maybe_save()

    def _apply(self, pushes: list[dict]) -> None:
        """Sum the pushes' gradients per row (in the given order) and apply them once."""
        self.sync.version += 1
        for name, opt in self.opts.items():
            parts = [p[name] for p in pushes if name in p]
            if not parts:
                continue
            ids = torch.cat([ids for ids, _ in parts])
            grads = torch.cat([g for _, g in parts])
            uniq_U, inv = torch.unique(ids, return_inverse=True)
            summed_UC = torch.zeros(len(uniq_U), grads.shape[1], dtype=grads.dtype).index_add_(0, inv, grads)
            opt.apply(uniq_U, summed_UC)

    def _maybe_save(self) -> None:
        """Save when the slowest worker reaches a multiple of ``save_every`` (and, if a folder is set, at the end)."""
        step = min(self.sync.clock)
        every = self.cfg.save_every
        if self.ckpt_dir and step != self.saved_step and every and step % every == 0:
            self.save(self.ckpt_dir, step)

    def save(self, folder: str, step: int) -> None:
        """``<folder>/step_<step>/<name>.pt``: one folder per step, so servers that died mid-save never mix."""
        path = Path(folder) / f"step_{step:07d}"
        path.mkdir(parents=True, exist_ok=True)
        state = {"servers": self.S, "step": step, "version": self.sync.version, "tables": self.tables,
                 "opts": {n: o.state_dict() for n, o in self.opts.items()}}
        tmp = path / f"{self.name}.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path / f"{self.name}.pt")  # atomic: a crash never leaves half a file
        self.saved_step = step

    def load(self, folder: str) -> None:
        path = latest_complete(folder, self.S) / f"{self.name}.pt"
        state = torch.load(path, weights_only=True)
        for n, t in self.tables.items():
            t.copy_(state["tables"][n])
            self.opts[n].load_state_dict(state["opts"][n])
        self.sync.version = int(state["version"])
        self.sync.clock = [int(state["step"])] * self.W
        self.saved_step = int(state["step"])


def latest_complete(folder: str, servers: int) -> Path:
    """The newest ``step_*`` folder holding every one of ``servers`` servers' tables."""
    root = Path(folder)
    steps = sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []
    for path in steps:
        if all((path / f"ps{s}.pt").is_file() for s in range(servers)):
            if (path / f"ps{servers}.pt").is_file():
                raise ConfigError(f"ps.resume tables in '{folder}' were saved by more than "
                                  f"ps.servers={servers} servers")
            return path
    raise ConfigError(f"ps.resume folder '{folder}' holds no complete set of tables for {servers} servers")
