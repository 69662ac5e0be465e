"""Autograd-aware all-to-all with uneven splits: the dispatch and combine steps of expert parallelism.

Forward: rank i sends ``input_splits[j]`` rows to rank j and receives ``output_splits[j]`` rows from
rank j (rank order). Backward: the inverse all-to-all of the gradient (the two split lists swap),
so the gradient of every row returns to the rank that sent it. Identity on a size-1 group.
"""

from __future__ import annotations

import torch

from tessera import comm
from tessera.comm.group import CommGroup


def _exchange(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group: CommGroup) -> torch.Tensor:
    out = x_ND.new_empty((sum(out_splits), *x_ND.shape[1:]))
    comm.all_to_all(out, x_ND.contiguous(), group, output_split_sizes=out_splits, input_split_sizes=in_splits)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x_ND, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_MD):
        return _exchange(grad_MD, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group: CommGroup) -> torch.Tensor:
    """Rows ``x_ND`` split by ``in_splits`` go to the group's ranks; returns the received rows [M, D]."""
    if group.size == 1:
        return x_ND
    return _AllToAll.apply(x_ND, list(out_splits), list(in_splits), group)


def exchange_counts(count_RX: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Row r of ``count_RX`` [ranks, X] goes to rank r; returns [ranks, X], row s from rank s."""
    if group.size == 1:
        return count_RX
    out = torch.empty_like(count_RX)
    comm.all_to_all(out, count_RX.contiguous(), group)
    return out
