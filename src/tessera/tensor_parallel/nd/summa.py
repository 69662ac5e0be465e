"""SUMMA linear layers: Colossal-AI's 2D (q×q) and 2.5D (q×q×d) tensor parallelism.

Y = X Aᵀ with X [T, I] and the weight A [O, I] (nn.Linear orientation). Rank (dep, i, j) holds the
activation block X_ij [T/(d·q), I/q] (tokens split over depth and grid rows, features over grid columns)
and the weight block A_ji [O/q, I/q] (output block j, input block i), the same on every depth layer.

Forward, for k = 0..q-1 (SUMMA): broadcast X_ik along the row (from column k) and A_jk along the column
(from row k); Y_ij += X_ik A_jkᵀ. Per layer: q broadcasts of T/(dq)·I/q and q of O/q·I/q elements.
Backward, for k = 0..q-1: broadcast A_jk along the column, reduce dY_ij A_jk along the row to column k
(= dX_ik); broadcast X_ik along the row, reduce dY_ijᵀ X_ik along the column to row k (= dA_jk). Under 2.5D
the weight gradient is then all-reduced over the d depth layers (each saw 1/d of the tokens), or, with
``shard_replicas``, each depth layer holds 1/d of the block's rows, all-gathered over depth in forward and
reduce-scattered in backward (``replicas.py``: the same bytes, and each weight element held once).

Bias (optional, e.g. Qwen2's q/k/v): b [O] is cut like the output, block j [O/q] added to Y_ij. Every rank
of column j (the q grid rows × d depth layers, each holding other tokens) adds the same block, so it is a
replicated block over ``col`` and ``depth`` (``replicas.py``): forward all-gather of the held rows
[O/(q²d)] into [O/q] (``shard_replicas``; otherwise no communication), backward reduce-scatter of its
gradient Σ_tokens dY_ij (otherwise all-reduce) over the same groups.

LoRA (an adapted dense layer, A [r, I], B [O, r]): rank (dep, i, j) uses A's column block j [r, I/q] and
B's row block j [O/q, r], both shared by column j like the bias (held once or replicated the same way).
h_ij = X_ij A_jᵀ [T/(dq), r] is partial over the row: fwd all-reduce over ``row`` (T/(dq)·r elements, the
one collective the adapter adds; small next to SUMMA's since r ≪ I/q), then Y_ij += scale · h Bⱼᵀ. Bwd:
all-reduce of dh = dY_ij B_j over ``row`` (each rank's covers its output block), then the two blocks'
gradients are summed over their replicas as the bias's is.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera import comm
from tessera.comm import collectives as C
from tessera.lora import has_adapter, lora_delta
from tessera.models.init import assign
from tessera.tensor_parallel.adapters import attach_adapter
from tessera.tensor_parallel.linear import mark_sharded
from tessera.tensor_parallel.nd.grid import Grid2D
from tessera.tensor_parallel.nd.replicas import local_rows, row_offset, whole_block


def _bcast(t: torch.Tensor, group, src: int) -> torch.Tensor:
    buf = t.contiguous().clone() if group.rank == src else torch.empty_like(t)
    C.broadcast(buf, group, src=src)
    return buf


def _reduce_to(t: torch.Tensor, group, dst: int) -> torch.Tensor | None:
    t = t.contiguous()
    C.reduce(t, group, dst=dst)
    return t if group.rank == dst else None


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TI, w_OI, grid: Grid2D):
        ctx.save_for_backward(x_TI, w_OI)
        ctx.grid = grid
        y_TO = x_TI.new_zeros(x_TI.shape[0], w_OI.shape[0])
        for k in range(grid.q):
            y_TO += _bcast(x_TI, grid.row, k) @ _bcast(w_OI, grid.col, k).t()
        return y_TO

    @staticmethod
    def backward(ctx, dy_TO):
        x_TI, w_OI = ctx.saved_tensors
        grid = ctx.grid
        dy_TO = dy_TO.contiguous()
        dx, dw = None, None
        for k in range(grid.q):
            got = _reduce_to(dy_TO @ _bcast(w_OI, grid.col, k), grid.row, k)
            dx = got if got is not None else dx
            if ctx.needs_input_grad[1]:  # a frozen weight (LoRA's base) needs neither broadcast nor reduce
                got = _reduce_to(dy_TO.t() @ _bcast(x_TI, grid.row, k), grid.col, k)
                dw = got if got is not None else dw
        return dx, dw, None


class Linear2D(nn.Module):
    """A linear layer on a 2D / 2.5D grid, with an optional bias. Input [..., I/q] → output [..., O/q],
    tokens split over depth × rows. Communication: see the module docstring; the 2.5D depth reduction of
    the weight gradient comes from ``whole_block`` over the depth group (``shard_replicas``: see
    ``replicas.py``), the bias's over ``col`` and ``depth`` likewise."""

    def __init__(self, in_features: int, out_features: int, grid: Grid2D, shard_replicas: bool = False,
                 device: torch.device | None = None, bias: bool = False):
        super().__init__()
        q, held_by = grid.q, grid.d if shard_replicas else 1  # a block [O/q, I/q] split by rows over depth
        if in_features % q or out_features % (q * held_by):
            raise ValueError(f"a {in_features}→{out_features} layer cannot be split over a {q}×{q}×{grid.d} grid")
        self.grid, self.in_features, self.out_features = grid, in_features, out_features
        self.replicas, self.shard_replicas = (grid.depth,), shard_replicas
        weight = torch.empty(out_features // (q * held_by), in_features // q, device=device)
        self.weight = mark_sharded(nn.Parameter(weight))
        self.bias_replicas = (grid.col, grid.depth)  # the ranks adding output block j to other tokens
        self.bias = None
        if bias:
            held = out_features // q // (q * grid.d if shard_replicas else 1)  # [O/(q²d)] or [O/q]
            b = nn.Parameter(torch.zeros(held, device=device))
            self.bias = mark_sharded(b) if shard_replicas else b

    @classmethod
    def from_linear(cls, linear: nn.Linear, grid: Grid2D, shard_replicas: bool = False) -> Linear2D:
        layer = cls(linear.in_features, linear.out_features, grid, shard_replicas, linear.weight.device,
                    bias=linear.bias is not None)
        block = linear.weight.chunk(grid.q, dim=0)[grid.j].chunk(grid.q, dim=1)[grid.i]  # a view (meta: origin)
        assign(layer.weight, local_rows(block, layer.replicas, shard_replicas))
        if linear.bias is not None:
            bias_block = linear.bias.chunk(grid.q)[grid.j]  # [O/q], a view
            assign(layer.bias, local_rows(bias_block, layer.bias_replicas, shard_replicas))
        if has_adapter(linear):
            layer._split_adapter(linear)
        return layer

    def _split_adapter(self, linear: nn.Linear) -> None:
        """Column block j of A and row block j of B (module doc), held like the bias."""
        if linear.lora_dropout.p > 0:
            raise ValueError("the grid layers have no dropout, so a LoRA adapter on them cannot have one")
        q, j, groups, held = self.grid.q, self.grid.j, self.bias_replicas, self.shard_replicas
        a = local_rows(linear.lora_A.weight.chunk(q, dim=1)[j], groups, held)  # views: [r(/qd), I/q]
        b = local_rows(linear.lora_B.weight.chunk(q, dim=0)[j], groups, held)  # [O/q(/qd), r]
        attach_adapter(self, linear, a, (row_offset(a.shape[0], groups, held), j * (self.in_features // q)), held,
                       b, (j * (self.out_features // q) + row_offset(b.shape[0], groups, held), 0), held)

    def region(self, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(single-process shape, offsets in it) of this rank's weight [O, I] or (a 1-dim ``shape``) bias
        [O], for checkpoints."""
        block_rows = self.out_features // self.grid.q
        if len(shape) == 1:
            start = self.grid.j * block_rows + row_offset(shape[0], self.bias_replicas, self.shard_replicas)
            return (self.out_features,), (start,)
        rows, cols = shape
        start = self.grid.j * block_rows + row_offset(rows, self.replicas, self.shard_replicas)
        return (self.out_features, self.in_features), (start, self.grid.i * cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = whole_block(self.weight, self.replicas, self.shard_replicas)  # [O/q, I/q]
        y_TO = _Summa.apply(x.reshape(-1, x.shape[-1]), w, self.grid)
        if self.bias is not None:
            y_TO = y_TO + whole_block(self.bias, self.bias_replicas, self.shard_replicas).to(y_TO.dtype)  # [O/q]
        if has_adapter(self):
            row, groups, held = self.grid.row, self.bias_replicas, self.shard_replicas
            y_TO = y_TO + lora_delta(self, x.reshape(-1, x.shape[-1]), a=whole_block(self.lora_A.weight, groups, held),
                                     b=whole_block(self.lora_B.weight, groups, held),
                                     mid=lambda h: comm.reduce_from(comm.copy_to(h, row), row))  # [T, O/q]
        return y_TO.view(*x.shape[:-1], -1)
