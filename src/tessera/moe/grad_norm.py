"""Global gradient norm and clipping for an expert-parallel model.

Dense gradients are identical on every rank after ExpertDataParallel's reduction, but each ep rank holds
the gradients of different experts: the global squared norm is the dense part (counted once) plus the
sum over the ep group of each rank's expert part. Every rank then applies the same clipping factor, so
the replicated parameters stay identical. Communication: one all-reduce of one float on ``ep``.
"""

from __future__ import annotations

from torch import nn

from tessera.comm.group import CommGroup
from tessera.grad_norm import clip_pieces, param_pieces
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
    extra = {f"sharded{i}": g for i, g in enumerate(sharded_over)}
    pieces = param_pieces(params, lambda p: ("ep",) if id(p) in experts else (), always=frozenset(extra))
    return clip_pieces(pieces, max_norm, {"ep": ep, **extra}, params[0].grad.device)
