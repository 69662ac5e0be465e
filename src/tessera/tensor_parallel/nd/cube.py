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

Bias (optional, e.g. Qwen2's q/k/v): b [O] is cut like the output, block a [O/q] added after the
reduce-scatter. The q² ranks with this ``gather`` coordinate hold the other token blocks of output block a,
so each holds [O/q³] of it (``replicas.py``): forward all-gather over ``weight`` and ``reduce`` into [O/q];
backward reduce-scatter over them of its gradient Σ_tokens dy (every token's contribution summed once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.comm.group import CommGroup
from tessera.models.init import assign
from tessera.tensor_parallel.linear import mark_sharded
from tessera.tensor_parallel.nd.replicas import local_rows, row_offset, whole_block
from tessera.tensor_parallel.regions import gather_seq, reduce_scatter_seq


class Linear3D(nn.Module):
    """A linear layer on a 3D cube, with an optional bias; tokens are split along the leading (batch)
    dimension."""

    def __init__(self, in_features: int, out_features: int, gather: CommGroup, weight: CommGroup,
                 reduce: CommGroup, device: torch.device | None = None, bias: bool = False):
        super().__init__()
        q = gather.size
        if in_features % q or out_features % (q * q):
            raise ValueError(f"a {in_features}→{out_features} layer cannot be split over a {q}×{q}×{q} cube")
        self.gather, self.weight_axis, self.reduce = gather, weight, reduce
        self.in_features, self.out_features = in_features, out_features
        weight = torch.empty(out_features // (q * q), in_features // q, device=device)
        self.weight = mark_sharded(nn.Parameter(weight))
        self.bias_replicas = (self.weight_axis, reduce)  # the ranks adding output block a to other tokens
        self.bias = mark_sharded(nn.Parameter(torch.zeros(out_features // q**3, device=device))) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather: CommGroup, weight: CommGroup, reduce: CommGroup) -> Linear3D:
        layer = cls(linear.in_features, linear.out_features, gather, weight, reduce, linear.weight.device,
                    bias=linear.bias is not None)
        q = gather.size
        block = linear.weight.chunk(q, dim=0)[gather.rank].chunk(q, dim=1)[reduce.rank]  # a view (meta: origin)
        assign(layer.weight, block.chunk(q, dim=0)[weight.rank])
        if linear.bias is not None:
            assign(layer.bias, local_rows(linear.bias.chunk(q)[gather.rank], layer.bias_replicas, True))
        return layer

    def region(self, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(single-process shape, offsets in it) of this rank's weight [O, I] or (a 1-dim ``shape``) bias
        [O], for checkpoints."""
        q = self.gather.size
        if len(shape) == 1:
            start = self.gather.rank * (self.out_features // q) + row_offset(shape[0], self.bias_replicas, True)
            return (self.out_features,), (start,)
        rows, cols = shape
        return (self.out_features, self.in_features), ((self.gather.rank * q + self.weight_axis.rank) * rows,
                                                       self.reduce.rank * cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_full = gather_seq(x, self.gather, dim=0)  # [R/q, ..., I/q]
        w_full = gather_seq(self.weight, self.weight_axis, dim=0)  # [O/q, I/q]
        y = reduce_scatter_seq(F.linear(x_full, w_full), self.reduce, dim=0)  # [R/q², ..., O/q]
        if self.bias is not None:
            y = y + whole_block(self.bias, self.bias_replicas, True).to(y.dtype)  # [O/q]
        return y
