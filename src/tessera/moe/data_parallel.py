"""Data parallelism for an expert-parallel model: dense gradients over ``dp``, expert gradients over ``edp``.

A dense parameter is replicated on every data-parallel rank, so its gradient is summed over ``dp``.
An expert lives on one rank of each ep group; its copies are the ``edp`` ranks (same ep index in the
other ep groups), and after backward it already holds the gradient of every token its ep group sent
it, so it is summed over ``edp`` only. Both sums follow the house loss convention (each micro-batch's
summed loss divided by the GLOBAL token count), which makes the result equal one process.

Forward communication: none (at construction dense state is broadcast from dp rank 0 and expert state
from edp rank 0). Backward communication: at the end of each synchronised backward, one coalesced
all-reduce (sum) of the dense gradients on ``dp`` and one of the expert gradients on ``edp``:
2(dp−1)/dp · dense bytes + 2(edp−1)/edp · local expert bytes per rank. Inside ``no_sync()`` gradients
only accumulate. A parameter without a gradient contributes zeros.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.moe.expert_parallel import apply_expert_parallel, expert_parameters


class ExpertDataParallel(nn.Module):
    """Wraps an expert-parallel ``module``; ``dp`` and ``edp`` are CommGroups from the Topology."""

    def __init__(self, module: nn.Module, dp: CommGroup, edp: CommGroup):
        super().__init__()
        self.module, self.dp, self.edp = module, dp, edp
        experts = {id(p) for p in expert_parameters(module)}
        params = [p for p in module.parameters() if p.requires_grad]
        self.groups = [
            ([p for p in params if id(p) not in experts], dp),
            ([p for p in params if id(p) in experts], edp),
        ]
        self._sync, self._queued = True, False
        self._broadcast_state()
        if dp.size > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def dense_parameters(self) -> list[nn.Parameter]:
        return self.groups[0][0]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        for params, group in self.groups:
            if params and group.size > 1:
                flat = torch.cat([p.reshape(-1) for p in params])
                comm.broadcast(flat, group, src=0)
                torch._foreach_copy_(params, [f.view_as(p) for f, p in zip(flat.split([p.numel() for p in params]), params)])
        for buf in self.module.buffers():
            comm.broadcast(buf.data, self.dp, src=0)

    def _on_grad(self, _p: nn.Parameter) -> None:
        if self._sync and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    @torch.no_grad()
    def _reduce(self) -> None:
        """Sum every gradient over its group; one flat all-reduce per group, issued in a fixed order."""
        self._queued = False
        for params, group in self.groups:
            if not params or group.size == 1:
                continue
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group, op="sum")
            for p, piece in zip(params, flat.split([p.numel() for p in params])):
                p.grad = piece.view_as(p).clone() if p.grad is None else p.grad.copy_(piece.view_as(p))


def expert_parallelize(model: nn.Module, topology) -> ExpertDataParallel:
    """The expert-parallel step of ``parallelize``: shard the experts of ``model`` over the topology's
    ``ep`` group, then reduce dense gradients over ``dp`` and expert gradients over ``edp``."""
    apply_expert_parallel(model, topology.group("ep"))
    return ExpertDataParallel(model, topology.group("dp"), topology.group("edp"))
