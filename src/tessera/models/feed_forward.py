"""The SwiGLU feed-forward: the dense block's MLP and each expert of a mixture of experts.

Its own module so that ``layers.py`` (the block, which picks a dense or an MoE feed-forward) and
``moe.py`` (whose experts are this MLP) both import it and neither imports the other's importer.
Submodule names ``w1``, ``w3``, ``w2`` are a contract with tensor parallelism and checkpoints.

Legend: B batch, S sequence, D model dim, F ffn hidden dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x). w1 = gate, w3 = up, w2 = down; no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # [F, D]
        self.w3 = nn.Linear(dim, hidden, bias=False)  # [F, D]
        self.w2 = nn.Linear(hidden, dim, bias=False)  # [D, F]

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))
