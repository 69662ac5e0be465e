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

LoRA (an adapted dense layer, A [r, I], B [O, r]): the rank uses A's column block c [r, I/q] (shared by
the q² ranks with this ``reduce`` coordinate, held once: [r/q², I/q]) and B's row block a [O/q, r] (shared
like the bias: [O/q³, r]); forward all-gathers both blocks over their sharers, then adds scale ·
(x_full A_cᵀ) B_aᵀ [R/q, O/q] to the partial product before the reduce-scatter, so the sum over c that
completes x Wᵀ completes x Aᵀ Bᵀ too: no collective on activations beyond the layer's own. Backward: dh
from the gathered dy, dx into the layer's reduce-scatter over ``gather``; the blocks' gradients
reduce-scattered over their sharers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.comm.group import CommGroup
from tessera.lora import has_adapter, lora_delta
from tessera.models.init import assign
from tessera.tensor_parallel.adapters import attach_adapter
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
        if has_adapter(linear):
            layer._split_adapter(linear)
        return layer

    @property
    def adapter_a_replicas(self) -> tuple[CommGroup, ...]:
        """The ranks sharing A's input block c: every ``gather`` and ``weight`` coordinate."""
        return (self.gather, self.weight_axis)

    def _split_adapter(self, linear: nn.Linear) -> None:
        """Column block c of A and row block a of B (module doc), each held once over its sharers."""
        if linear.lora_dropout.p > 0:
            raise ValueError("the grid layers have no dropout, so a LoRA adapter on them cannot have one")
        q, a_groups, b_groups = self.gather.size, self.adapter_a_replicas, self.bias_replicas
        a = local_rows(linear.lora_A.weight.chunk(q, dim=1)[self.reduce.rank], a_groups, True)  # [r/q², I/q]
        b = local_rows(linear.lora_B.weight.chunk(q, dim=0)[self.gather.rank], b_groups, True)  # [O/q³, r]
        a_at = (row_offset(a.shape[0], a_groups, True), self.reduce.rank * (self.in_features // q))
        b_at = (self.gather.rank * (self.out_features // q) + row_offset(b.shape[0], b_groups, True), 0)
        attach_adapter(self, linear, a, a_at, True, b, b_at, True)

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
        y_part = F.linear(x_full, w_full)  # [R/q, ..., O/q], partial over the reduce axis
        if has_adapter(self):
            y_part = y_part + lora_delta(self, x_full, a=whole_block(self.lora_A.weight, self.adapter_a_replicas, True),
                                         b=whole_block(self.lora_B.weight, self.bias_replicas, True))
        y = reduce_scatter_seq(y_part, self.reduce, dim=0)  # [R/q², ..., O/q]
        if self.bias is not None:
            y = y + whole_block(self.bias, self.bias_replicas, True).to(y.dtype)  # [O/q]
        return y
