"""Gradient norm and clipping when some parameters are split over tp and others replicated.

‖g‖² = Σ_tp ranks ‖g_sharded,r‖² + ‖g_replicated‖²: the sharded parameters' squares are all-reduced over
the tp group, the replicated ones (norm weights, biases of row-parallel layers) are counted once — every
tp rank holds the same full gradient of those. The rule itself lives in ``tessera.grad_norm``. Vocabulary padding rows have zero gradient and add nothing.
"""

from __future__ import annotations

import torch

from tessera.comm.group import CommGroup
from tessera.grad_norm import global_grad_norm, param_pieces, scale_to
from tessera.tensor_parallel.linear import is_sharded


def grad_norm(parameters, tp: CommGroup) -> torch.Tensor:
    """The global L2 norm of the gradients of ``parameters`` (a 0-d float32 tensor, equal on every tp rank)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    pieces = param_pieces(params, lambda p: ("tp",) if is_sharded(p) else ())  # tied weights count once
    return global_grad_norm(pieces, {"tp": tp}, params[0].grad.device)


def clip_grad_norm_(parameters, max_norm: float, tp: CommGroup) -> torch.Tensor:
    """Scale gradients in place so the global norm is at most ``max_norm``; return the norm before."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, tp)
    scale_to([p.grad.detach() for p in params], total, max_norm)
    return total
