"""Frozen parameters under mixed precision: held in the training dtype alone.

A parameter that needs no gradient (``requires_grad=False``: a LoRA job's base weights) is never
updated, so it needs no fp32 master, no gradient and no optimizer state: an engine that holds it whole
(ZeRO-0/1/2, whose masters cover the trainable parameters only) casts it to the compute dtype once, and it
stays that way (bf16: 2 bytes per element instead of 4). ZeRO-3 does the same per flat shard
(``tessera.zero.flat_param``). Trainable parameters are left to the engine's buckets.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


@torch.no_grad()
def hold_frozen(params: Iterable[nn.Parameter], dtype: torch.dtype) -> int:
    """Cast every floating-point parameter of ``params`` that needs no gradient to ``dtype``, in place (the
    Parameter object and its attributes stay; a tied one is cast once). Returns the bytes it now holds."""
    held, seen = 0, set()
    for p in params:
        if p.requires_grad or not p.is_floating_point() or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
        held += p.numel() * p.element_size()
    return held
