"""A weight block that several grid ranks need whole: replicated (Colossal-AI) or held once and gathered.

In the 2D / 2.5D / 3D layouts some weight blocks are used by several ranks that see different tokens: a
norm weight's feature block by every rank of the other batch blocks, a 2.5D weight block by every depth
layer, the embedding's block by the ranks it is not split over. ``groups`` are those ranks, as the grid
axes along which the block repeats (r = the product of their sizes).

- replicated (``sharded=False``, the papers' layout): every rank holds the block [n, ...]; forward uses it
  as is; backward all-reduces its gradient over each group (``copy_to``), since each replica saw other
  tokens. Bytes per rank: the whole block.
- held once (``sharded=True``, the trainer's layout): rank holds rows ``block.chunk(g1)[c1].chunk(g2)[c2]…``
  ([n/r, ...]); forward all-gathers them over each group (last group first) into the block; backward
  reduce-scatters the gradient back (the same bytes as the all-reduce: a reduce-scatter plus an
  all-gather). Every element of the model then lives on exactly one tp rank, so gradient clipping, ZeRO
  and checkpoints count it once with no knowledge of the grid.
"""

from __future__ import annotations

import torch

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.tensor_parallel.regions import gather_seq


def local_rows(block: torch.Tensor, groups: tuple[CommGroup, ...], sharded: bool) -> torch.Tensor:
    """This rank's part of ``block`` [n, ...]: the block itself, or its rows [n/r, ...] when ``sharded``."""
    if not sharded:
        return block
    for g in groups:
        if block.shape[0] % g.size:
            raise ValueError(f"a block of {block.shape[0]} rows cannot be split over {g.size} '{g.axis}' ranks")
        block = block.chunk(g.size, dim=0)[g.rank]
    return block


def row_offset(rows_local: int, groups: tuple[CommGroup, ...], sharded: bool) -> int:
    """Where this rank's rows start inside the block (0 when replicated)."""
    if not sharded:
        return 0
    start, span = 0, rows_local
    for g in reversed(groups):  # the innermost split is the last group's
        start += g.rank * span
        span *= g.size
    return start


def whole_block(w: torch.Tensor, groups: tuple[CommGroup, ...], sharded: bool) -> torch.Tensor:
    """The block [n, ...] for forward, with the backward that sums the replicas' gradients."""
    if sharded:
        for g in reversed(groups):
            w = gather_seq(w, g, dim=0)
        return w
    for g in groups:
        w = comm.copy_to(w, g)
    return w
