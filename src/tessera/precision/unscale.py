"""Undo a loss scale on gradients and agree, job-wide, whether they are finite.

A loss multiplied by S gives gradients multiplied by S; they are divided by S before anything reads them
(the gradient norm, clipping, the optimizer), and an inf/nan on any rank must make *every* rank skip the
step, or replicas drift apart and collectives that only finite ranks issue (the clipping norm) hang.
The check is one 0-d all-reduce (max) per group in ``groups``; orthogonal groups that together span the
job (or the world group alone) make the answer the same on every rank.
"""

from __future__ import annotations

from typing import Iterable

import torch

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.grad_norm import tensor_norms


@torch.no_grad()
def nonfinite(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-d fp32 flag on ``device``: 1 if any of ``tensors`` holds an inf or nan, else 0.

    Read from the tensors' fp32 norms (``tessera.grad_norm.tensor_norms``: one fused pass per dtype that
    allocates nothing per element; an elementwise ``isfinite`` mask cost 3.4 ms on a 1.5M-element ZeRO
    slice against 0.17 ms). A norm is also inf when finite values beyond about 1e19 overflow its fp32 sum
    of squares: such a gradient is flagged too, as an overflow, which it is for clipping and the optimizer."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for norms in tensor_norms(tensors):
        flag = torch.maximum(flag, (~torch.isfinite(norms)).any().float().to(device))
    return flag


def agree_finite(flag: torch.Tensor, groups: Iterable[CommGroup]) -> bool:
    """Whether no rank of ``groups`` raised its ``flag`` (the flag is reduced in place)."""
    for group in groups:
        comm.all_reduce(flag, group, op="max")
    return not bool(flag)


@torch.no_grad()
def unscale_(grads: Iterable[torch.Tensor], inv_scale: float, groups: Iterable[CommGroup],
             device: torch.device) -> bool:
    """Multiply ``grads`` in place by ``inv_scale`` (1/S); returns whether every rank's are finite."""
    grads = list(grads)
    if inv_scale != 1.0:
        for g in grads:
            g.mul_(inv_scale)
    return agree_finite(nonfinite(grads, device), groups)
