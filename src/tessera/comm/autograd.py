"""Autograd-aware collectives: the four region boundaries of Megatron-style tensor parallelism.

Each is the identity on a size-1 group (whose device is still checked). Legend: N = group size; ``dim``
the split dimension.

    copy_to      forward: identity              backward: all-reduce (sum) of the gradient
    reduce_from  forward: all-reduce (sum)      backward: identity
    gather_from  forward: all-gather along dim  backward: keep this rank's slice of the gradient
    scatter_to   forward: keep this rank's slice backward: all-gather the gradient along dim

``copy_to`` / ``reduce_from`` are conjugate (f and g in the Megatron paper), as are ``gather_from`` /
``scatter_to``: the forward communication of one is the backward communication of the other.
"""

from __future__ import annotations

import torch

from tessera.comm import collectives as C
from tessera.comm.group import CommGroup


def _gather_along(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """[.., n, ..] on each rank → [.., N·n, ..] in rank order (all-gather works on dim 0, so move dim)."""
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * x0.shape[0], *x0.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather(out, x0, group)
    return out.movedim(0, dim)


def _local_slice(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(
            f"cannot split dim {dim} of size {x.shape[dim]} evenly over {group.size} ranks of '{group.axis}'"
        )
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        C.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        C.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _local_slice(grad, ctx.group, ctx.dim), None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _local_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, ctx.group, ctx.dim), None, None


def copy_to(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Enter a parallel region with a replicated input. Fwd: identity. Bwd: all-reduce(sum) of grad."""
    group.check_device("copy_to", x)
    return x if group.size == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Leave a parallel region by summing partial results. Fwd: all-reduce(sum). Bwd: identity."""
    group.check_device("reduce_from", x)
    return x if group.size == 1 else _ReduceFrom.apply(x, group)


def gather_from(x: torch.Tensor, group: CommGroup, dim: int = -1) -> torch.Tensor:
    """Leave a parallel region by concatenating shards. Fwd: all-gather along ``dim``. Bwd: own slice."""
    group.check_device("gather_from", x)
    return x if group.size == 1 else _GatherFrom.apply(x, group, dim % x.dim())


def scatter_to(x: torch.Tensor, group: CommGroup, dim: int = -1) -> torch.Tensor:
    """Enter a parallel region by splitting ``dim``. Fwd: own slice. Bwd: all-gather of grad along ``dim``."""
    group.check_device("scatter_to", x)
    return x if group.size == 1 else _ScatterTo.apply(x, group, dim % x.dim())
