"""The synchronous parameter servers as data-parallel modes (``ddp.mode = "ps-rank0" | "ps-sharded"``,
``ddp.consistency = "sync"``; the contract: ``tessera.train.dp_modes.base``).

They are the trainer's form of ``tessera.parameter_server.dense``'s "ps_rank0" and "ps_sharded" exchanges,
for any model and with what the trainer adds: mixed precision (fp32 masters), the loss scale, the global
gradient norm over tp / pp, and a pipeline's stages. Each equals one-process training.
"""

from __future__ import annotations

import torch

from tessera import comm
from tessera.comm import CommGroup
from tessera.comm.flat import copy_from_flat, unflatten_views
from tessera.grad_norm import clip_grad_norm
from tessera.precision.unscale import unscale_
from tessera.train.dp_modes.base import DataParallelMode, ModeParts, placeholder_optimizer


class RankZeroServerMode(DataParallelMode):
    """``ddp.mode = "ps-rank0"`` (consistency "sync") for the trainer: the data-parallel rank 0 of each
    replica group is the server and its optimizer holds the only state (the workers' is a placeholder the
    lr schedule drives). In fp32 the served copy is the server's own parameters, so a checkpoint is rank
    0's pieces; with bf16 / fp16 parameters the server keeps fp32 masters beside them, which the
    checkpoint's pieces do not reach (``checkpoint.every`` / ``resume`` are refused then).

    Per step, on every rank: gather the flat gradient [P] (in ``precision.reduce_dtype``) to the server,
    which sums in fp32, unscales, checks finiteness (with the servers of the other tp slices), clips by the
    norm of the summed gradient (that of one process) and steps; one broadcast of [norm, overflow], then
    one of the new parameters [P] (in the parameter dtype, rounded from the masters). Bytes per worker:
    b_reduce·P up, b_param·P down; the server's link carries (N-1) times that. Under a pipeline the mode is
    per stage (``tessera.train.dp_modes.assemble``): each stage's dp rank 0 serves that stage's parameters."""

    def __init__(self, parts: ModeParts):
        model, self.dp, self.device = parts.model, parts.dp, parts.device
        self.dtype, self.reduce_dtype = parts.precision.param_dtype, parts.precision.grad_reduce_dtype
        for p in model.parameters():  # mixed precision: the parameters in the compute dtype (as an engine holds them)
            p.data = p.data.to(self.dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.server = self.dp.rank == 0
        self.mixed = self.dtype != torch.float32
        # what the server steps: its parameters themselves in fp32, else fp32 masters of them
        self.masters = ([p.detach().float().clone().requires_grad_() for p in self.params]
                        if self.server and self.mixed else self.params)
        master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        param_of = {id(m): p for p, m in zip(self.params, self.masters)}
        self.tp, self.norm_axes = parts.groups["tp"], parts.norm_axes
        self.axes_of = lambda m: parts.axes_of(param_of[id(m)])  # a master is split like its parameter
        groups = [{**g, "params": [master_of[id(p)] for p in g["params"]]} for g in parts.param_groups(model)]
        optimizer = (parts.make_optimizer(groups) if self.server
                     else placeholder_optimizer(parts.make_optimizer, groups, parts.device))
        super().__init__(model, optimizer)

    @torch.no_grad()
    def update(self, max_norm: float, scaler) -> float | None:
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params]
        gathered = comm.gather(torch.cat(grads).to(self.reduce_dtype), self.dp, dst=0)
        status = torch.zeros(2, device=self.device)  # [norm, overflow]: the server's verdict
        if self.server:  # summed in fp32 whatever dtype the gradients travelled in
            status[:] = self._serve(torch.stack(gathered).float().sum(0), max_norm, scaler)
        comm.broadcast(status, self.dp, src=0)
        if not scaler.update(not bool(status[1])):
            return None
        if self.server:
            self.optimizer.step()
        flat_P = torch.cat([m.detach().reshape(-1) for m in self.masters]).to(self.dtype) if self.server else \
            torch.empty(self.numel, dtype=self.dtype, device=self.device)
        comm.broadcast(flat_P, self.dp, src=0)
        if self.mixed or not self.server:  # the served fp32 values into the (compute-dtype) parameters
            copy_from_flat(self.params, flat_P)
        return float(status[0])

    def _serve(self, total_P: torch.Tensor, max_norm: float, scaler) -> torch.Tensor:
        """On the server: the summed gradient [P] into the masters' grads, unscaled, checked, clipped."""
        for m, g in zip(self.masters, unflatten_views(total_P, self.masters)):
            m.grad = g  # a view: unscaling total_P below unscales the masters' gradients
        # the servers of every tp slice (and of every stage under a pipeline: norm_axes' "pp")
        checks = [self.tp, *(g for axis, g in self.norm_axes.items() if axis != "tp")]
        if not unscale_([total_P], 1.0 / scaler.scale if scaler.active else 1.0, checks, self.device):
            return torch.tensor([float("inf"), 1.0])
        norm = clip_grad_norm(self.masters, self.norm_axes, max_norm, axes_of=self.axes_of, device=self.device)
        return torch.tensor([norm, 0.0])

    def zero_grad(self) -> None:
        super().zero_grad()
        for m in self.masters:
            m.grad = None


class ShardedServerMode(DataParallelMode):
    """``ddp.mode = "ps-sharded"`` (consistency "sync"): the server spread over the data-parallel ranks, each
    owning 1/N of every flat bucket of parameters with its optimizer state. That is ZeRO-1's engine with
    the exchange at the step instead of in backward (``manual``): reduce-scatter the gradients (each owner
    receives the sum of its slice), unscale / check / clip by the global norm over the owners' slices,
    step the owned slice, all-gather the parameters. Bytes per rank: 2·(N-1)/N·P·(reduce dtype, then
    parameter dtype), the ring all-reduce's volume; fp32 masters and mixed precision are the engine's."""

    def __init__(self, parts: ModeParts):
        from tessera.zero.build import build_engine

        replicate = CommGroup.single("dp_replicate", parts.dp.ledger, parts.dp.device)
        engine = build_engine(parts.model, parts.param_groups(parts.model), parts.make_optimizer, parts.dp,
                              replicate, 1, parts.zero, parts.precision, parts.device,
                              norm_axes=parts.norm_axes, param_axes=parts.axes_of, manual=True)
        super().__init__(engine, engine.optimizer, engine)

    def update(self, max_norm: float, scaler) -> float | None:
        self.engine.reduce_gradients()
        norm, finite = self.engine.clip_grad_norm(max_norm, inv_scale=1.0 / scaler.scale)
        if not scaler.update(finite):
            return None
        self.engine.step()
        return norm


def build_server_mode(parts: ModeParts) -> DataParallelMode:
    """The synchronous parameter servers of ``registry.MODES``."""
    return RankZeroServerMode(parts) if parts.ddp.mode == "ps-rank0" else ShardedServerMode(parts)
