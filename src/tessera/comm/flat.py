"""Tensors laid end to end in one flat 1-D buffer and back: one collective moves many tensors (the gradient
buckets, ZeRO's flat parameters and every coalesced message read their pieces with these)."""

from __future__ import annotations

import torch


def offsets_of(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Start offset of each tensor in a flat buffer (end to end from 0, as ``torch.cat`` of them flattened
    lays them), and the unpadded total."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += t.numel()
    return offsets, total


def unflatten_views(flat: torch.Tensor, like: list[torch.Tensor],
                    offsets: list[int] | None = None) -> list[torch.Tensor]:
    """Views into the 1-D ``flat``, shaped like ``like``: tensor i is ``flat[offsets[i] : offsets[i] + numel]``
    (``offsets`` left out: end to end from 0)."""
    if offsets is None:
        offsets = offsets_of(like)[0]
    return [flat[o : o + t.numel()].view_as(t) for t, o in zip(like, offsets)]


@torch.no_grad()
def copy_from_flat(tensors: list[torch.Tensor], flat: torch.Tensor, offsets: list[int] | None = None) -> None:
    """Copy each tensor's piece of ``flat`` into it in place (cast to its dtype); layout as ``unflatten_views``."""
    for t, piece in zip(tensors, unflatten_views(flat, tensors, offsets)):
        t.copy_(piece)
