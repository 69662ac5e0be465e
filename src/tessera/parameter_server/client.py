"""A worker's view of the servers: pull rows by global id, push their gradients, fail loudly on a dead server.

Every call goes to every server (an empty request still advances that server's clock for the worker,
which SSP and BSP need), concurrently with ``rpc_async``, and each future waits at most ``ps.timeout``.
A server that died makes the next call fail within that time (usually at once: its connection
closes) with a :class:`PSError` that names it. Bytes moved are recorded in a CommLedger on axis "ps"
(op "pull": ids sent + rows received; op "push": ids + gradient rows sent), and per server.
"""

from __future__ import annotations

import time

import torch
import torch.distributed.rpc as rpc

from tessera.comm import CommLedger
from tessera.models.ctr import SPARSE_TABLES
from tessera.parameter_server.config import PSConfig
from tessera.parameter_server.errors import PSError, last_line
from tessera.parameter_server.server import dense_owner, serve_call


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PSClient:
    def __init__(self, worker: int, cfg: PSConfig, dense: list[str], ledger: CommLedger | None = None):
        self.worker, self.cfg, self.S = worker, cfg, cfg.servers
        self.dense_at = {name: dense_owner(i, self.S) for i, name in enumerate(dense)}
        self.ledger = ledger or CommLedger()
        self.server_bytes = [0] * self.S  # bytes this worker exchanged with each server
        self.versions = [0] * self.S  # each server's version at this worker's last pull

    def _call(self, method: str, step: int, per_server: list[tuple]) -> list:
        futs = [rpc.rpc_async(f"ps{s}", serve_call, args=(f"ps{s}", method, *args), timeout=self.cfg.timeout)
                for s, args in enumerate(per_server)]
        out = []
        for s, fut in enumerate(futs):
            try:
                out.append(fut.wait())
            except Exception as err:  # noqa: BLE001 - RPC reports a dead peer with several types
                raise PSError(f"worker {self.worker}: parameter server ps{s} failed to answer {method} for "
                              f"step {step} (it died, hung or gave up): {last_line(err)}") from None
        return out

    def pull(self, step: int, rows_U: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sparse rows ``rows_U`` (unique global ids) of every sparse table, and every dense tensor (flat)."""
        start = time.perf_counter()
        shard_of_U = rows_U % self.S
        picks = [torch.nonzero(shard_of_U == s).flatten() for s in range(self.S)]
        requests = []
        for s in range(self.S):
            req = {n: rows_U[picks[s]] // self.S for n in SPARSE_TABLES}
            req.update({n: torch.zeros(1, dtype=torch.long) for n, o in self.dense_at.items() if o == s})
            requests.append((self.worker, step, req))
        answers = self._call("pull", step, requests)
        out = {}
        for name in SPARSE_TABLES:
            width = answers[0][0][name].shape[1]
            full = torch.empty(len(rows_U), width)
            for s, (rows, _) in enumerate(answers):
                full[picks[s]] = rows[name]
            out[name] = full
        for s, (rows, version) in enumerate(answers):
            self.versions[s] = version
            for name, o in self.dense_at.items():
                if o == s:
                    out[name] = rows[name][0]
            self.server_bytes[s] += _nbytes(*requests[s][2].values(), *rows.values())
        moved = sum(_nbytes(*r[2].values()) + _nbytes(*a[0].values()) for r, a in zip(requests, answers))
        self.ledger.record("ps", "pull", moved, moved, time.perf_counter() - start)
        return out

    def push(self, step: int, rows_U: torch.Tensor, sparse_grads: dict[str, torch.Tensor],
             dense_grads: dict[str, torch.Tensor]) -> None:
        """Gradients of the rows pulled for this step ([U, C] per sparse table) and of every dense tensor."""
        start = time.perf_counter()
        shard_of_U = rows_U % self.S
        requests = []
        for s in range(self.S):
            pick = torch.nonzero(shard_of_U == s).flatten()
            grads = {n: (rows_U[pick] // self.S, g[pick]) for n, g in sparse_grads.items()}
            grads.update({n: (torch.zeros(1, dtype=torch.long), g.reshape(1, -1))
                          for n, g in dense_grads.items() if self.dense_at[n] == s})
            requests.append((self.worker, step, grads, self.versions[s]))
            self.server_bytes[s] += sum(_nbytes(i, g) for i, g in grads.values())
        self._call("push", step, requests)
        moved = sum(_nbytes(i, g) for r in requests for i, g in r[2].values())
        self.ledger.record("ps", "push", moved, moved, time.perf_counter() - start)

    def start_step(self) -> int:
        return self._call("start_step", -1, [()] * self.S)[0]

    def final_state(self, steps: int) -> list:
        return self._call("final_state", steps, [(steps,)] * self.S)
