"""Asynchronous data parallelism for any model: a parameter server hosted inside the training ranks.

``[ddp] mode = "ps-rank0" | "ps-sharded"`` with ``consistency = "ssp" | "async"``. Parameters are served
as whole tensors: tensor i (in ``model.parameters()`` order) lives on server rank 0 (ps-rank0) or on rank
``i % N`` (ps-sharded, the CTR job's ``dense_owner`` rule), in fp32, with its optimizer state; every rank
is also a worker. After its backward a worker clips its own gradient by its own norm (``optim.grad_clip``;
no collective), pushes each server the gradients of the tensors it serves, and pulls them back:

    worker w, step t:  forward/backward on its batch share  ->  g_P (P = every trainable element)
                       push g[slice of server s] to every s ->  server applies it on arrival (one
                       optimizer step of its own, lr as configured)  ->  reply: params, version

Scaling: the pushed gradient is that of the worker's summed token loss divided by the tokens *this
worker* holds (the trainer's ``tokens_group`` is this rank alone), i.e. the mean-loss gradient of its own
batch share; each push is applied on its own, so one step of N workers makes N optimizer updates.
With one worker this is exactly one-process training.

Consistency (``parameter_server.consistency``, shared with the CTR job): "async" replies at once; "ssp"
replies to a push of step t only when every worker finished step t + 1 - s - 1, so a worker starts step
t + 1 at most s steps ahead of the slowest. Each applied push's staleness (updates between the worker's
pull and its push) is recorded per server; every push reaches every server, so rank 0's histogram counts
each push once.

Transport: c10d point-to-point, one two-rank group per (server, worker) pair, served on the server rank
by one thread per remote worker (its own group, so the trainer's collectives on other groups never
interleave with it). Every receive waits at most ``parallel.timeout_s`` and fails naming the rank.
A message is a header int64[3] = (kind, step, read_version), then for a push the flat fp32 gradient
[n_s] of server s's tensors; the reply is int64[1] = version, then the flat parameters [n_s] in the
compute dtype (``precision.dtype``).

Mixed precision (bf16, fp16): the servers keep their tensors in fp32 (the masters,
cloned before the model's parameters are cast) and serve them rounded to the compute dtype, in which the
workers compute; a worker takes its gradient to fp32 before clipping it by its own norm and pushes that
fp32 gradient (rounding the clipped gradient would lose what one process does), and the server steps its
fp32 masters. With one worker this is exactly one process in bf16 (fp32 masters, compute-dtype copies).
A dynamic loss scale (fp16) is each worker's own: the synchronous modes must agree job-wide whether a
step is skipped, because every replica applies the same update; here no step is shared (each push is
applied on its own), so a worker whose gradient overflowed skips its push and lowers its scale alone.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.comm import CommGroup, CommLedger
from tessera.comm.flat import copy_from_flat, unflatten_views
from tessera.errors import ConfigError
from tessera.grad_norm import GradPiece, clip_grad_norm
from tessera.parameter_server.consistency import StalenessClock
from tessera.parameter_server.errors import PSError
from tessera.parameter_server.server import dense_owner
from tessera.precision.unscale import nonfinite
from tessera.train.dp_modes.base import DataParallelMode, ModeParts, placeholder_optimizer

PS_MODES = ("ps-rank0", "ps-sharded")
CONSISTENCIES = ("ssp", "async")
MAX_WORKERS = 64  # the pair groups grow as N·(N−1): see validate_async
PUSH, PULL, CLOSE = 0, 1, 2  # message kinds


def is_async(ddp) -> bool:
    """Whether ``[ddp]`` asks for this module: a parameter-server mode with a consistency other than sync."""
    return ddp.mode in PS_MODES and ddp.consistency in CONSISTENCIES


def validate_async(cfg, parallel) -> None:
    """Refuse, before any rank starts, what cannot compose with a server hosted in the ranks (one sentence)."""
    ddp = cfg.ddp
    if ddp.consistency not in ("sync", *CONSISTENCIES):
        raise ConfigError(f"ddp.consistency must be sync, ssp or async, got '{ddp.consistency}'")
    if ddp.staleness < 0:
        raise ConfigError(f"ddp.staleness must not be negative, got {ddp.staleness}")
    if not is_async(ddp):
        return
    why = "the parameter server holds each tensor whole with its optimizer state and applies each push on its own"
    if parallel.zero_stage > 0:
        raise ConfigError(f"ddp.consistency={ddp.consistency} cannot use parallel.zero_stage "
                          f"{parallel.zero_stage}: {why}, so there is no optimizer state left for ZeRO to shard")
    for axis in ("pp", "tp", "cp", "ep"):
        if getattr(parallel, axis) > 1:
            degree = getattr(parallel, axis)
            what = ("the stages of one pipeline replica carry each micro-batch's forward and backward between "
                    "them, so they must hold one weight version within a step" if axis == "pp" else
                    "the ranks of one model replica must compute a step on one weight version")
            raise ConfigError(f"ddp.consistency={ddp.consistency} cannot use parallel.{axis}={degree}: {what}, "
                              f"while each rank here pulls its own version whenever it pushes; use data "
                              f"parallelism alone")
    workers = parallel.dp_replicate * parallel.dp_shard
    if workers > MAX_WORKERS:
        raise ConfigError(f"ddp.consistency={ddp.consistency} runs at most {MAX_WORKERS} data-parallel ranks, got "
                          f"{workers}: every rank creates one process group per (server, worker) pair, up to "
                          f"N·(N−1) = {workers * (workers - 1)}, and each server rank serves N−1 workers from a "
                          f"thread apiece; use ddp.consistency=sync or fewer ranks")
    if str(cfg.zero.offload) != "none":
        raise ConfigError(f"ddp.consistency={ddp.consistency} cannot use zero.offload={cfg.zero.offload}: offload "
                          f"moves a sharded engine's masters and optimizer state, and here {why}")


def build_async_mode(parts: ModeParts) -> AsyncParameterServer:
    """The ``(ps-rank0 | ps-sharded, ssp | async)`` entries of ``registry.MODES``."""
    d = parts.ddp
    return AsyncParameterServer(parts.model, parts.groups["world"], d.mode, d.consistency, d.staleness,
                                parts.param_groups(parts.model), parts.make_optimizer, parts.dp.ledger,
                                dtype=parts.precision.param_dtype)


def server_of(index: int, mode: str, world: int) -> int:
    """The rank serving trainable tensor ``index``."""
    return 0 if mode == "ps-rank0" else dense_owner(index, world)


class ShardServer:
    """The tensors one rank serves (fp32 clones) and their optimizer, behind a StalenessClock; pulls get
    them in ``dtype`` (the workers' compute dtype)."""

    def __init__(self, rank: int, params: list[torch.Tensor], groups: list[dict], make_optimizer,
                 workers: int, bound: int | None, timeout: float, dtype: torch.dtype = torch.float32):
        self.rank, self.dtype = rank, dtype
        self.clones = [p.detach().float().clone().requires_grad_() for p in params]
        clone_of = {id(p): c for p, c in zip(params, self.clones)}
        mine = [{**g, "params": [clone_of[id(p)] for p in g["params"] if id(p) in clone_of]} for g in groups]
        self.optimizer = make_optimizer([g for g in mine if g["params"]])
        self.sync = StalenessClock(f"on rank {rank}", workers, bound, timeout)

    def push(self, worker: int, step: int, grads: list[torch.Tensor], read_version: int) -> None:
        with self.sync.cond:
            self.sync.record(read_version)
            for c, g in zip(self.clones, grads):
                c.grad = g.to(c.dtype).view_as(c)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.sync.version += 1
            self.sync.tick(worker, step)

    def pull(self, worker: int, step: int | None) -> tuple[int, torch.Tensor]:
        """(version, flat parameters [n_s]) for starting step ``step`` (SSP may wait); None: now, no gate."""
        with self.sync.cond:
            if step is not None:
                self.sync.gate(worker, step)
            return self.sync.version, torch.cat([c.detach().reshape(-1) for c in self.clones]).to(self.dtype)


class AsyncParameterServer(DataParallelMode):
    """The mode (``tessera.train.dp_modes.base``' contract): ``update`` after each backward, ``before_eval``
    before validation, ``stats()`` for the metrics, ``close()`` at the end (collective). ``dtype``: the
    compute dtype the model's parameters are cast to (the servers' clones stay fp32)."""

    def __init__(self, model: nn.Module, world: CommGroup, mode: str, consistency: str, staleness: int,
                 groups: list[dict], make_optimizer: Callable, ledger: CommLedger | None = None,
                 dtype: torch.dtype = torch.float32):
        self.world, self.rank, self.N = world, world.rank, world.size
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.owner = [server_of(i, mode, self.N) for i in range(len(self.params))]
        self.servers = sorted(set(self.owner))
        # server -> the tensors it serves, in ``self.params`` order (fixed: the model and the layout are)
        self.served = {s: [p for p, o in zip(self.params, self.owner) if o == s] for s in self.servers}
        timeout = world.timeout.total_seconds()
        bound = staleness if consistency == "ssp" else None
        self.server = None
        if self.rank in self.servers:
            self.server = ShardServer(self.rank, self.served[self.rank], groups, make_optimizer, self.N, bound,
                                      timeout, dtype)
        self.dtype = dtype
        for p in model.parameters():  # after the servers cloned their fp32 masters: compute in ``dtype``
            p.data = p.data.to(dtype)
        super().__init__(model, self.server.optimizer if self.server
                         else placeholder_optimizer(make_optimizer, groups, world.device))  # drives the lr schedule
        # the step's token count and loss stay on this rank: a collective there would make every worker wait
        self.step_group = CommGroup.single("ps_worker", ledger, world.device)
        self.read_version = {s: 0 for s in self.servers}
        self.step = 0
        self.errors: list[str] = []
        # (server, worker) -> CommGroup; the serving threads record into their own ledger, not the step's
        self.links = _pair_groups(world, self.servers, ledger or CommLedger(), CommLedger())
        self.threads = [threading.Thread(target=self._serve, args=(w,), daemon=True)
                        for (s, w) in self.links if s == self.rank]
        for t in self.threads:
            t.start()

    # ---- worker side -----------------------------------------------------------------------------
    def update(self, grad_clip: float, scaler=None) -> float | None:
        """Clip this worker's gradient by its own norm, push it to every server, pull the parameters for the
        next step (waiting there under SSP). Returns the norm before clipping, or None when this worker's
        gradient overflowed: the gradient is taken to fp32 (the servers' masters are fp32) and unscaled
        first; a loss scale (fp16) is this worker's own, since nothing it computes reaches another worker
        but through its push: an inf/nan skips its push (no server sees this step, its clock does not
        advance) and lowers its own scale, while the other workers go on."""
        self._raise_if_failed()
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).float() for p in self.params]
        if scaler is not None and scaler.active:
            for g in grads:
                g.mul_(1.0 / scaler.scale)
            if not scaler.update(not bool(nonfinite(grads, self.world.device))):
                return None
        norm = clip_grad_norm([GradPiece(g) for g in grads], {}, grad_clip, device=self.world.device)
        sent = [self._send(s, PUSH, [g for g, o in zip(grads, self.owner) if o == s])
                for s in self.servers if s != self.rank]
        if self.server is not None:
            self.server.push(self.rank, self.step, [g for g, o in zip(grads, self.owner) if o == self.rank],
                             self.read_version[self.rank])
        self.step += 1
        self._pull_all(sent, self.step)
        return norm

    def before_eval(self) -> None:
        """Make the model's parameters the servers' current ones (validation reads the server's state).
        Collective: after the barrier every worker's pushes so far are applied and none is in flight, so
        every rank evaluates the same parameters."""
        self._raise_if_failed()
        comm.barrier(self.world)
        self._pull_all([self._send(s, PULL, []) for s in self.servers if s != self.rank], None)

    def _send(self, server: int, kind: int, grads: list[torch.Tensor]):
        link = self.links[(server, self.rank)]
        header = torch.tensor([kind, self.step, self.read_version[server]], dtype=torch.int64,
                              device=link.device)
        handles = [comm.isend(header, link, _peer(link))]
        if grads:
            handles.append(comm.isend(torch.cat([g.reshape(-1) for g in grads]).float(), link, _peer(link)))
        return handles

    def _pull_all(self, sent, step: int | None) -> None:
        for h in (h for hs in sent for h in hs):
            h.wait()
        for s in self.servers:
            if s == self.rank:
                version, flat = self.server.pull(self.rank, step)
            else:
                link = self.links[(s, self.rank)]
                head = torch.empty(1, dtype=torch.int64, device=link.device)
                flat = torch.empty(sum(p.numel() for p in self.served[s]), dtype=self.dtype, device=link.device)
                comm.recv(head, link, _peer(link))
                comm.recv(flat, link, _peer(link))
                version = int(head[0])
            self.read_version[s] = version
            copy_from_flat(self.served[s], flat)

    # ---- server side (one thread per remote worker) ----------------------------------------------
    def _serve(self, worker: int) -> None:
        link = self.links[(self.rank, worker)]
        peer = _peer(link)
        head = torch.empty(3, dtype=torch.int64, device=link.device)
        grad = torch.empty(sum(c.numel() for c in self.server.clones), device=link.device)
        try:
            while True:
                comm.recv(head, link, peer)
                kind, step, read_version = (int(v) for v in head.tolist())
                if kind == CLOSE:
                    return
                if kind == PUSH:
                    comm.recv(grad, link, peer)
                    self.server.push(worker, step, unflatten_views(grad, self.server.clones), read_version)
                version, flat = self.server.pull(worker, step + 1 if kind == PUSH else None)
                comm.send(torch.tensor([version], dtype=torch.int64, device=link.device), link, peer)
                comm.send(flat, link, peer)
        except Exception as err:  # noqa: BLE001 - reported by the worker loop of this rank, in one sentence
            self.errors.append(f"rank {self.rank} serving rank {worker}: {str(err).splitlines()[0][:300]}")
            with self.server.sync.cond:
                self.server.sync.cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self.errors:
            raise PSError(f"parameter server failed: {self.errors[0]}")

    # ---- reporting and the end -------------------------------------------------------------------
    def stats(self) -> dict:
        """Staleness of the pushes applied so far, as rank 0's server counted them (every push reaches it)."""
        if self.server is None:
            return {}
        with self.server.sync.cond:
            hist = dict(sorted(self.server.sync.staleness.items()))
            gap = self.server.sync.max_gap
        count = sum(hist.values())
        return {"staleness_max": max(hist, default=0), "staleness_mean": sum(k * v for k, v in hist.items())
                / max(count, 1), "staleness_hist": {str(k): v for k, v in hist.items()}, "ssp_max_gap": gap}

    def close(self) -> None:
        """Tell every server this worker is done, wait for this rank's serving threads, free the groups."""
        for s in self.servers:
            if s != self.rank:
                for h in self._send(s, CLOSE, []):
                    h.wait()
        for t in self.threads:
            t.join(timeout=self.world.timeout.total_seconds())
        self._raise_if_failed()
        comm.barrier(self.world)
        for link in self.links.values():
            dist.destroy_process_group(link.pg)
        self.links = {}


def _pair_groups(world: CommGroup, servers: list[int], ledger: CommLedger,
                 serve_ledger: CommLedger) -> dict[tuple[int, int], CommGroup]:
    """One two-rank group per (server, worker ≠ server), created in the same order on every rank (collective)."""
    links = {}
    for s in servers:
        for w in range(world.size):
            if w == s:
                continue
            ranks = sorted((world.ranks[s], world.ranks[w]))
            pg = dist.new_group(ranks, timeout=world.timeout)
            if world.rank in (s, w):
                links[(s, w)] = CommGroup("ps", pg, tuple(ranks), world.global_rank,
                                          serve_ledger if world.rank == s else ledger, world.timeout, world.device)
    return links


def _peer(link: CommGroup) -> int:
    """The group-local index of a two-rank link's other member."""
    return 1 - link.rank
