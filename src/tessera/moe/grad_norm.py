"""Global gradient norm and clipping for an expert-parallel model.

Dense gradients are identical on every rank after ExpertDataParallel's reduction, but each ep rank holds
the gradients of different experts: the global squared norm is the dense part (counted once) plus the
sum over the ep group of each rank's expert part. Every rank then applies the same clipping factor, so
the replicated parameters stay identical. Communication: one all-reduce of one float on ``ep``.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.moe.expert_parallel import expert_parameters


def clip_grad_norm_moe(model: nn.Module, max_norm: float, ep: CommGroup,
                       sharded_over: list[CommGroup] = ()) -> float:
    """Clip all gradients of ``model`` to a global L2 norm (``max_norm`` ≤ 0: only measure); returns the
    norm before clipping. ``sharded_over``: further groups across which every gradient is sharded
    (tensor or pipeline parallelism), summed for dense and expert parts alike."""
    experts = {id(p) for p in expert_parameters(model)}
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    sq = torch.zeros(2, dtype=torch.float32, device=params[0].grad.device)  # [dense, expert]
    for p in params:
        sq[int(id(p) in experts)] += p.grad.detach().float().pow(2).sum()
    expert_sq = sq[1:].clone()
    comm.all_reduce(expert_sq, ep)
    total = (sq[0] + expert_sq[0]).reshape(1)
    for group in sharded_over:
        comm.all_reduce(total, group)
    norm = total[0].sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(scale.to(p.grad.dtype))
    return float(norm)
