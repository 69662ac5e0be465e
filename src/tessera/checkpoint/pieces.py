"""What a rank contributes to a layout-independent checkpoint: pieces of single-process tensors.

Every tensor of a checkpoint is named and shaped as in a single-process run (``model/layers.3.attention.
wq.weight`` of shape [D, D], ``optim/layers.3.attention.wq.weight/exp_avg`` …). A rank holds some
rectangular parts of some of them — a tensor-parallel column block, a pipeline stage's layers, a ZeRO
flat-shard range cut into rectangles, an expert-parallel rank's experts — and describes each part as a
:class:`Piece`: the global name and shape, where the part starts, and a local view holding its values.

Saving writes each piece once (pieces with the same name and offsets on several ranks are replicas and
are deduplicated); loading fills every piece a rank asks for from whatever pieces were written, so a
checkpoint saved under one layout loads under any other (resharding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """A rectangular part of one single-process tensor, held by this rank.

    ``tensor`` is a view of live storage (a parameter, an optimizer state, a slice of a flat shard) with
    ``tensor.shape`` the part's size: saving reads it, loading copies into it in place. Its region is
    ``[offsets[d], offsets[d] + tensor.shape[d])`` along each dimension ``d`` of ``global_shape``.
    A 0-d tensor (a step counter) has ``global_shape == offsets == ()``.
    """

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        shape = tuple(self.tensor.shape)
        if len(shape) != len(self.global_shape) or len(self.offsets) != len(shape):
            raise ValueError(f"piece {self.name}: rank of tensor {shape}, offsets {self.offsets} and global "
                             f"shape {self.global_shape} differ")
        for d, (o, n, g) in enumerate(zip(self.offsets, shape, self.global_shape)):
            if o < 0 or o + n > g:
                raise ValueError(f"piece {self.name}: dimension {d} spans [{o}, {o + n}) outside [0, {g})")

    @staticmethod
    def whole(name: str, tensor: torch.Tensor) -> Piece:
        """A tensor this rank holds entirely (replicated, or owned by this rank alone)."""
        return Piece(name, tuple(tensor.shape), (0,) * tensor.dim(), tensor)
