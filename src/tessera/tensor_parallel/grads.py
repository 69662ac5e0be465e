"""Gradient norm and clipping when some parameters are split over tp and others replicated.

‖g‖² = Σ_tp ranks ‖g_sharded,r‖² + ‖g_replicated‖²: the sharded parameters' squares are all-reduced over
the tp group, the replicated ones (norm weights, biases of row-parallel layers) are counted once — every
tp rank holds the same full gradient of those. Vocabulary padding rows have zero gradient and add nothing.
"""

from __future__ import annotations

import torch

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.tensor_parallel.linear import is_sharded


def grad_norm(parameters, tp: CommGroup) -> torch.Tensor:
    """The global L2 norm of the gradients of ``parameters`` (a 0-d float32 tensor, equal on every tp rank)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    device = params[0].grad.device
    sq = torch.zeros(2, dtype=torch.float32, device=device)  # [sharded Σ, replicated Σ]
    seen = set()
    for p in params:
        if id(p) in seen:  # tied weights count once
            continue
        seen.add(id(p))
        sq[0 if is_sharded(p) else 1] += p.grad.detach().float().pow(2).sum()
    sharded = sq[:1].clone()
    comm.all_reduce(sharded, tp)
    return (sharded[0] + sq[1]).sqrt()


def clip_grad_norm_(parameters, max_norm: float, tp: CommGroup) -> torch.Tensor:
    """Scale gradients in place so the global norm is at most ``max_norm``; return the norm before."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, tp)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(scale.to(p.grad.device))
    return total
