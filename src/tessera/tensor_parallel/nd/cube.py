"""3D tensor-parallel linear layer (Colossal-AI 3D, after Agarwal et al.'s 3D matrix multiplication).

On a q×q×q cube a layer is given three roles, each a grid axis: ``gather`` (the axis along which the
input's rows are split a second time), ``weight`` (along which the weight is split a second time) and
``reduce`` (the contraction axis). With a = coordinate on ``gather``, c = coordinate on ``reduce``:

    input   x [R/q², I/q]   rows block (row0, a) of the tokens, input-feature block c
    weight  w [O/q², I/q]   output block a, split again over ``weight``; input block c
    output  y [R/q², O/q]   rows block (row0, c), output-feature block a

Forward: all-gather x over ``gather`` → [R/q, I/q]; all-gather w over ``weight`` → [O/q, I/q];
y_partial = x wᵀ; reduce-scatter y over ``reduce`` (sums the contraction) → [R/q², O/q].
Backward, the conjugates: all-gather dy over ``reduce``; reduce-scatter dx over ``gather``; reduce-scatter
dw over ``weight`` (the tokens of the other weight-axis ranks contributed to it).
The output layout is the input layout with ``gather`` and ``reduce`` swapped, so two layers with swapped
roles (an MLP's up and down projections) return to where they started.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.comm.group import CommGroup
from tessera.models.init import assign
from tessera.tensor_parallel.linear import mark_sharded
from tessera.tensor_parallel.regions import gather_seq, reduce_scatter_seq


class Linear3D(nn.Module):
    """A linear layer on a 3D cube (no bias); tokens are split along the leading (batch) dimension."""

    def __init__(self, in_features: int, out_features: int, gather: CommGroup, weight: CommGroup,
                 reduce: CommGroup, device: torch.device | None = None):
        super().__init__()
        q = gather.size
        if in_features % q or out_features % (q * q):
            raise ValueError(f"a {in_features}→{out_features} layer cannot be split over a {q}×{q}×{q} cube")
        self.gather, self.weight_axis, self.reduce = gather, weight, reduce
        self.in_features, self.out_features = in_features, out_features
        weight = torch.empty(out_features // (q * q), in_features // q, device=device)
        self.weight = mark_sharded(nn.Parameter(weight))

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather: CommGroup, weight: CommGroup, reduce: CommGroup) -> Linear3D:
        if linear.bias is not None:
            raise ValueError("Linear3D has no bias; the reference model's linears have none")
        layer = cls(linear.in_features, linear.out_features, gather, weight, reduce, linear.weight.device)
        q = gather.size
        block = linear.weight.chunk(q, dim=0)[gather.rank].chunk(q, dim=1)[reduce.rank]  # a view (meta: origin)
        assign(layer.weight, block.chunk(q, dim=0)[weight.rank])
        return layer

    def region(self, shape) -> tuple[tuple[int, int], tuple[int, int]]:
        """(single-process shape [O, I], offsets in it) of this rank's weight of ``shape``, for checkpoints."""
        rows, cols = shape
        q = self.gather.size
        return (self.out_features, self.in_features), ((self.gather.rank * q + self.weight_axis.rank) * rows,
                                                       self.reduce.rank * cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_full = gather_seq(x, self.gather, dim=0)  # [R/q, ..., I/q]
        w_full = gather_seq(self.weight, self.weight_axis, dim=0)  # [O/q, I/q]
        return reduce_scatter_seq(F.linear(x_full, w_full), self.reduce, dim=0)  # [R/q², ..., O/q]
