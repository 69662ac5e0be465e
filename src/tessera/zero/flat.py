"""Flat buffers: several parameters laid end to end in one 1-D tensor, padded so N ranks get equal
slices. Parameters then become views into the buffer, so one collective moves all of them."""

from __future__ import annotations

import torch
from torch import nn

from tessera.comm.flat import offsets_of
from tessera.data_parallel.buckets import padded_size

__all__ = ["flatten_fp32", "named_params_by_id", "offsets_of", "padded_size", "rank_slice", "slice_segments"]


@torch.no_grad()
def flatten_fp32(params: list[torch.Tensor], offsets: list[int], size: int) -> torch.Tensor:
    """[size] fp32 buffer holding ``params`` at ``offsets``, zeros in the padding."""
    flat = torch.zeros(size, dtype=torch.float32, device=params[0].device)
    for p, o in zip(params, offsets):
        flat[o : o + p.numel()].copy_(p.detach().reshape(-1))
    return flat


def rank_slice(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous 1/world of a padded flat buffer (a view)."""
    n = flat.numel() // world
    return flat[rank * n : (rank + 1) * n]


def named_params_by_id(module: nn.Module) -> dict[int, str]:
    """id(parameter) → its first qualified name (tied parameters keep one name)."""
    out: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=True):
        out.setdefault(id(p), name)
    return out


def slice_segments(offsets: list[int], numels: list[int], tags: list, rank: int, world: int,
                   padded: int) -> list[tuple[int, int, object]]:
    """(start, end, tag) inside this rank's slice for every parameter that overlaps it: which part of
    the slice belongs to which parameter (padding belongs to none), e.g. for a gradient norm that
    treats tensor-parallel-split and replicated parameters differently."""
    n = padded // world
    lo, hi = rank * n, (rank + 1) * n
    out = []
    for o, k, tag in zip(offsets, numels, tags):
        a, b = max(o, lo), min(o + k, hi)
        if a < b:
            out.append((a - lo, b - lo, tag))
    return out
