"""A Llama transformer block (RMSNorm, GQA attention, SwiGLU MLP) built from 2D / 2.5D / 3D linear layers.

Activation layout x [B/n_b, S, D/q]: the batch is split into n_b blocks (2D: q, 2.5D: d·q, 3D: q²) and the
features into q blocks; the whole sequence stays on each rank, so the attention core is local (each rank
holds H/q query heads and K/q kv heads of its batch block). The norm's mean square is all-reduced over the
ranks holding the other feature blocks (fwd and bwd: all-reduce of B/n_b·S floats); the norm weight, one
feature block shared by the other ranks, gets its gradient all-reduced over them (or, held once over them,
is all-gathered in forward and reduce-scattered in backward: ``replicas.py``).
Dropout is not supported here (the 1D path has it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.models.init import assign
from tessera.models.layers import apply_rope, causal_sdpa
from tessera.tensor_parallel.linear import mark_sharded
from tessera.tensor_parallel.nd.cube import Linear3D
from tessera.tensor_parallel.nd.grid import Grid2D, Grid3D
from tessera.tensor_parallel.nd.replicas import local_rows, row_offset, whole_block
from tessera.tensor_parallel.nd.summa import Linear2D


class Layout:
    """Where a rank's activation block sits and how to build the layers; see Layout2D / Layout3D.

    ``shard_replicas``: hold each replicated weight block once over its replicas (``replicas.py``), as the
    trainer does; False keeps the papers' replicated blocks (the block-level library and its tests)."""

    q: int
    n_batch: int  # batch blocks
    batch_block: int  # this rank's batch block (of a block's input)
    feature_block: int  # this rank's block of the model dim D (the block input and output)
    head_block: int  # this rank's block of heads / hidden units (between up and down projections)
    norm_group: CommGroup  # ranks holding the other feature blocks of the same tokens
    replica_groups: tuple[CommGroup, ...]  # ranks holding the same norm-weight block
    loss_block: int  # the batch block of an "up" layer's output (the logits)
    vocab_group: CommGroup  # ranks holding the other vocabulary blocks of the same logits rows
    embed_group: CommGroup  # the embedding's vocabulary split: same feature block, other batch blocks
    embed_replicas: tuple[CommGroup, ...]  # ranks holding the same embedding block
    grid_shape: tuple[int, ...]  # the grid's coordinates (last fastest) over the tp-local ranks
    vocab_axis: int  # which grid coordinate ``vocab_group`` varies
    shard_replicas: bool = False

    def up(self, linear: nn.Linear) -> nn.Module:  # D → hidden
        raise NotImplementedError

    def down(self, linear: nn.Linear) -> nn.Module:  # hidden → D
        raise NotImplementedError

    def shard(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full activation (for tests and for entering the ND region)."""
        return x_BSD.chunk(self.n_batch, 0)[self.batch_block].chunk(self.q, -1)[self.feature_block].contiguous()


class Layout2D(Layout):
    def __init__(self, grid: Grid2D, shard_replicas: bool = False):
        self.grid, self.q, self.n_batch = grid, grid.q, grid.q * grid.d
        self.batch_block, self.feature_block, self.head_block = grid.batch_block, grid.j, grid.j
        self.norm_group, self.replica_groups = grid.row, (grid.col, grid.depth)
        self.loss_block, self.vocab_group = grid.batch_block, grid.row  # logits [B/(dq), S, V/q]: block j
        self.embed_group, self.embed_replicas = grid.col, (grid.depth,)
        self.grid_shape, self.vocab_axis, self.shard_replicas = (grid.d, grid.q, grid.q), 2, shard_replicas

    def up(self, linear):
        return Linear2D.from_linear(linear, self.grid, self.shard_replicas)

    down = up


class Layout3D(Layout):
    def __init__(self, grid: Grid3D, shard_replicas: bool = False):
        self.grid, self.q, self.n_batch = grid, grid.q, grid.q * grid.q
        self.batch_block, self.feature_block, self.head_block = grid.batch_block, grid.z.rank, grid.y.rank
        self.norm_group, self.replica_groups = grid.z, (grid.x, grid.y)
        # an "up" layer returns rows (x, z) with output block y (cube.py): the logits' layout
        self.loss_block, self.vocab_group = grid.x.rank * grid.q + grid.z.rank, grid.y
        self.embed_group, self.embed_replicas = grid.y, (grid.x,)
        self.grid_shape, self.vocab_axis, self.shard_replicas = (grid.q,) * 3, 1, shard_replicas

    def up(self, linear):
        return Linear3D.from_linear(linear, self.grid.y, self.grid.x, self.grid.z)

    def down(self, linear):
        return Linear3D.from_linear(linear, self.grid.z, self.grid.x, self.grid.y)


class NormND(nn.Module):
    """RMSNorm over D split in q blocks. Fwd and bwd: all-reduce of the per-token sum of squares over the
    feature ranks; the weight block is shared by the replica groups (``replicas.py``: bwd all-reduce of its
    gradient, or, held once, fwd all-gather and bwd reduce-scatter)."""

    def __init__(self, norm: nn.Module, layout: Layout, dim: int):
        super().__init__()
        self.layout, self.eps, self.dim = layout, norm.eps, dim
        block = norm.weight.chunk(layout.q)[layout.feature_block]  # a view (not .detach(): no _base)
        rows = local_rows(block, layout.replica_groups, layout.shard_replicas)
        weight = nn.Parameter(torch.empty(rows.shape, dtype=rows.dtype, device=rows.device))
        self.weight = mark_sharded(weight) if layout.shard_replicas else weight
        assign(self.weight, rows)

    def region(self, shape) -> tuple[tuple[int], tuple[int]]:
        """(single-process shape [D], offset in it) of this rank's weight of ``shape``, for checkpoints."""
        n = shape[0]
        lay = self.layout
        start = lay.feature_block * (self.dim // lay.q) + row_offset(n, lay.replica_groups, lay.shard_replicas)
        return (self.dim,), (start,)

    def forward(self, x_BSd: torch.Tensor) -> torch.Tensor:
        g = self.layout.norm_group
        x32 = x_BSd.float()
        ss_BS1 = comm.reduce_from(comm.copy_to(x32.pow(2).sum(-1, keepdim=True), g), g)
        w = whole_block(self.weight, self.layout.replica_groups, self.layout.shard_replicas)  # [D/q]
        return (x32 * torch.rsqrt(ss_BS1 / self.dim + self.eps)).type_as(x_BSd) * w


class MLPND(nn.Module):
    """SwiGLU with w1, w3 as "up" layers and w2 as a "down" layer."""

    def __init__(self, ffn: nn.Module, layout: Layout):
        super().__init__()
        self.w1, self.w3, self.w2 = layout.up(ffn.w1), layout.up(ffn.w3), layout.down(ffn.w2)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class AttentionND(nn.Module):
    """Causal GQA attention: projections are ND layers; the core runs locally on H/q heads."""

    gqa_kernel = "repeat"  # set after build by tessera.kernels.apply_kernels (models.layers.causal_sdpa)

    def __init__(self, attn: nn.Module, layout: Layout):
        super().__init__()
        q = layout.q
        if attn.n_heads % q or attn.n_kv_heads % q:
            raise ValueError(f"q={q} must divide n_heads={attn.n_heads} and n_kv_heads={attn.n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads // q, attn.n_kv_heads // q, attn.head_dim
        self.wq, self.wk, self.wv = layout.up(attn.wq), layout.up(attn.wk), layout.up(attn.wv)
        self.wo = layout.down(attn.wo)

    def forward(self, x_BSd, cos, sin):
        b, s, _ = x_BSd.shape  # 3D: the projections' outputs hold another batch block of the same size
        q_BSHE = apply_rope(self.wq(x_BSd).view(b, s, -1, self.head_dim), cos, sin)
        k_BSKE = apply_rope(self.wk(x_BSd).view(b, s, -1, self.head_dim), cos, sin)
        v_BSKE = self.wv(x_BSd).view(b, s, -1, self.head_dim)
        y_BSHE = causal_sdpa(q_BSHE, k_BSKE, v_BSKE, self.gqa_kernel)
        return self.wo(y_BSHE.reshape(b, s, -1))


class TransformerBlockND(nn.Module):
    """h = x + attn(norm(x)); out = h + mlp(norm(h)), on activation blocks [B/n_b, S, D/q]."""

    def __init__(self, block: nn.Module, layout: Layout):
        super().__init__()
        dim = block.attention_norm.weight.shape[0]
        self.attention_norm, self.ffn_norm = NormND(block.attention_norm, layout, dim), NormND(block.ffn_norm, layout, dim)
        self.attention, self.feed_forward = AttentionND(block.attention, layout), MLPND(block.feed_forward, layout)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))
