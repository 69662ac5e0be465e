"""Wide & deep click-through-rate model over hashed categorical fields (single device, no torch.distributed).

Legend: B batch, F categorical fields, K hash buckets per field, D embedding width, H hidden width.

A sample is F categorical values, each already hashed into one of K buckets of its field. Field f's bucket
k is the global row ``f·K + k`` of two tables: ``embed`` ([F·K, D], the deep part's input) and ``wide``
([F·K, 1], a linear weight per feature, the wide part). Only the rows a batch touches get a gradient,
which is what a parameter server exploits: ``rows`` → ``lookup`` → ``head`` are exposed separately so a
worker can pull those rows from servers and call ``head`` on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessera.errors import ConfigError

SPARSE_TABLES = ("embed.weight", "wide.weight")  # the tables a parameter server shards by row


@dataclass
class CTRConfig:
    n_fields: int = 8  # F categorical fields per sample
    buckets: int = 1000  # K hash buckets per field (rows per field in each table)
    embed_dim: int = 8  # D width of a deep embedding row
    hidden: int = 32  # H width of the two hidden MLP layers

    def validate(self) -> CTRConfig:
        for name in ("n_fields", "buckets", "embed_dim", "hidden"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ctr.{name} must be at least 1, got {getattr(self, name)}")
        return self

    @property
    def rows(self) -> int:
        """Rows of each sparse table: F·K."""
        return self.n_fields * self.buckets


class WideDeep(nn.Module):
    """logit = Σ_f wide[row_f] + MLP(concat_f embed[row_f]) + bias. ``sparse=True`` gives sparse gradients."""

    def __init__(self, cfg: CTRConfig, sparse: bool = False):
        super().__init__()
        self.cfg = cfg.validate()
        self.embed = nn.Embedding(cfg.rows, cfg.embed_dim, sparse=sparse)
        self.wide = nn.Embedding(cfg.rows, 1, sparse=sparse)
        nn.init.normal_(self.embed.weight, std=0.1)
        nn.init.zeros_(self.wide.weight)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_fields * cfg.embed_dim, cfg.hidden), nn.ReLU(),
            nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU(),
            nn.Linear(cfg.hidden, 1),
        )

    def rows(self, fields_BF: torch.Tensor) -> torch.Tensor:
        """Bucket ids per field ([B, F], each in [0, K)) → global table rows [B, F]."""
        offsets_F = torch.arange(self.cfg.n_fields, device=fields_BF.device) * self.cfg.buckets
        return fields_BF + offsets_F

    def head(self, embed_BFD: torch.Tensor, wide_BF: torch.Tensor) -> torch.Tensor:
        """The dense part on looked-up rows → logits [B]."""
        deep_B = self.mlp(embed_BFD.flatten(1)).squeeze(-1)
        return deep_B + wide_BF.sum(1)

    def forward(self, fields_BF: torch.Tensor) -> torch.Tensor:
        rows_BF = self.rows(fields_BF)
        return self.head(self.embed(rows_BF), self.wide(rows_BF).squeeze(-1))


def dense_names(model: WideDeep) -> list[str]:
    """The parameters a parameter server keeps whole (everything but the sparse tables), in a fixed order."""
    return [n for n, _ in model.named_parameters() if n not in SPARSE_TABLES]
