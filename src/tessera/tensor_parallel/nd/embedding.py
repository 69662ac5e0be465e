"""The token embedding on a 2D / 2.5D / 3D grid: token ids of this rank's batch block → h [B/n_b, S, D/q].

The table T [V, D] is cut into q vocabulary blocks along ``embed_group`` (the ranks with this rank's
feature block that hold the other batch blocks of the same q: 2D the grid column, 3D the y axis) and q
feature blocks; rank (vocabulary block c, feature block f) holds T[c, f] [V/q, D/q], shared with
``embed_replicas`` (2.5D depth, 3D x; ``replicas.py``).

Forward: all-gather the ids over ``embed_group`` ([q·B/n_b, S] integers); look up the ids of block c (the
others read zeros); reduce-scatter the partial rows [q·B/n_b, S, D/q] over ``embed_group`` back to this
rank's batch block. Backward: all-gather of dh (the reduce-scatter's conjugate); each rank's table gets the
gradient of its vocabulary block's ids, summed over the replicas.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.comm import collectives as C
from tessera.models.init import assign
from tessera.tensor_parallel.linear import mark_sharded
from tessera.tensor_parallel.nd.replicas import local_rows, row_offset, whole_block
from tessera.tensor_parallel.regions import reduce_scatter_seq


class EmbeddingND(nn.Module):
    def __init__(self, emb: nn.Embedding, layout):
        super().__init__()
        q, g = layout.q, layout.embed_group
        self.layout, self.num_embeddings, self.dim = layout, emb.num_embeddings, emb.embedding_dim
        if self.num_embeddings % g.size or self.dim % q:
            raise ValueError(f"a {self.num_embeddings}×{self.dim} embedding cannot be split into {g.size}×{q} blocks")
        self.per_block = self.num_embeddings // g.size
        self.vocab_start = g.rank * self.per_block
        block = emb.weight[self.vocab_start:self.vocab_start + self.per_block]  # a view (not .detach(): no _base)
        rows = local_rows(block.chunk(q, dim=1)[layout.feature_block], layout.embed_replicas, layout.shard_replicas)
        self.weight = mark_sharded(nn.Parameter(torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)))
        assign(self.weight, rows)

    def region(self, shape) -> tuple[tuple[int, int], tuple[int, int]]:
        """(single-process shape [V, D], offsets in it) of this rank's table of ``shape``, for checkpoints."""
        lay, (rows, cols) = self.layout, shape
        start = self.vocab_start + row_offset(rows, lay.embed_replicas, lay.shard_replicas)
        return (self.num_embeddings, self.dim), (start, lay.feature_block * cols)

    def forward(self, tokens_bS: torch.Tensor) -> torch.Tensor:
        g = self.layout.embed_group
        ids_BS = torch.empty((g.size * tokens_bS.shape[0], *tokens_bS.shape[1:]), dtype=tokens_bS.dtype,
                             device=tokens_bS.device)
        C.all_gather(ids_BS, tokens_bS.contiguous(), g)  # the q batch blocks of this column, in rank order
        local_BS = ids_BS - self.vocab_start
        outside_BS = (local_BS < 0) | (local_BS >= self.per_block)
        table = whole_block(self.weight, self.layout.embed_replicas, self.layout.shard_replicas)  # [V/q, D/q]
        h_BSd = F.embedding(local_BS.masked_fill(outside_BS, 0), table)
        h_BSd = h_BSd.masked_fill(outside_BS.unsqueeze(-1), 0.0)  # ids of another vocabulary block read zeros
        return reduce_scatter_seq(h_BSd, g, dim=0)  # [B/n_b, S, D/q]: this rank's batch block, summed
