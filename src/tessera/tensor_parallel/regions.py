"""Sequence-parallel region boundaries (Megatron SP), the conjugates of ``tessera.comm.autograd``.

Activations outside the tensor-parallel regions are split along the sequence (dim 1 of x_BSD). Legend:
N = tp group size, S the full sequence, ``dim`` the split dimension.

    gather_seq          forward: all-gather along dim       backward: reduce-scatter (sum) along dim
    reduce_scatter_seq  forward: reduce-scatter along dim   backward: all-gather along dim

They replace ``copy_to`` (f) and ``reduce_from`` (g): an all-reduce is a reduce-scatter followed by an
all-gather, so the bytes on the wire are the same while everything between the boundaries holds 1/N of
the sequence.
"""

from __future__ import annotations

import torch

from tessera.comm import collectives as C
from tessera.comm.group import CommGroup


def _all_gather_dim(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """[.., n, ..] → [.., N·n, ..] in rank order (the collective works on dim 0, so move dim first)."""
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * x0.shape[0], *x0.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather(out, x0, group)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """[.., N·n, ..] partial sums → [.., n, ..]: this rank's slice of the sum over ranks."""
    if x.shape[dim] % group.size:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {group.size} ranks")
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((x0.shape[0] // group.size, *x0.shape[1:]), dtype=x.dtype, device=x.device)
    C.reduce_scatter(out, x0, group)
    return out.movedim(0, dim)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.group, ctx.dim), None, None


def gather_seq(x: torch.Tensor, group: CommGroup, dim: int = 1) -> torch.Tensor:
    """Enter a TP region from a sequence-split input. Fwd: all-gather along ``dim``. Bwd: reduce-scatter."""
    return x if group.size == 1 else _GatherSeq.apply(x, group, dim % x.dim())


def reduce_scatter_seq(x: torch.Tensor, group: CommGroup, dim: int = 1) -> torch.Tensor:
    """Leave a TP region into a sequence split. Fwd: reduce-scatter along ``dim``. Bwd: all-gather."""
    return x if group.size == 1 else _ReduceScatterSeq.apply(x, group, dim % x.dim())
