"""Preallocated key/value caches for decoding one sequence token by token.

Each layer keeps k and v [B, T_max, K, E] as attention computed them (after RoPE, before the kv heads are
repeated for grouped-query attention, so a cache is H / K times smaller than the repeated one). A forward
with a cache writes its S new positions at [length, length + S) of every layer and attends to [0, length
+ S); the model then advances the cache by S (``Transformer.forward(..., cache=)``).

Legend: B batch, T_max cache capacity in positions, S new positions, K kv heads, E head dim.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """One layer's view of the cache during one forward: positions [0, start) hold earlier tokens."""

    def __init__(self, k_BTKE: torch.Tensor, v_BTKE: torch.Tensor, start: int):
        self.k_BTKE, self.v_BTKE, self.start = k_BTKE, v_BTKE, start

    def update(self, k_BSKE: torch.Tensor, v_BSKE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys and values; return those of positions [0, start + S)."""
        end = self.start + k_BSKE.shape[1]
        if end > self.k_BTKE.shape[1]:
            raise ValueError(f"KV cache holds {self.k_BTKE.shape[1]} positions; position {end - 1} does not fit")
        self.k_BTKE[:, self.start:end] = k_BSKE
        self.v_BTKE[:, self.start:end] = v_BSKE
        return self.k_BTKE[:, :end], self.v_BTKE[:, :end]


class KVCache:
    """Every layer's keys and values for up to ``max_len`` positions of ``batch`` sequences."""

    def __init__(self, layer_ids: list[int], batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, max_len, n_kv_heads, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.max_len = max_len
        self.length = 0  # positions filled in every layer

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> KVCache:
        """A cache for a whole one-device ``tessera.models.Transformer`` (its dtype and device)."""
        cfg = model.cfg
        weight = model.tok_embeddings.weight
        return cls([int(name) for name in model.layers], batch, max_len, cfg.n_kv_heads, cfg.head_dim,
                   weight.dtype, weight.device)

    def layer(self, layer_id: int) -> LayerKVCache:
        return LayerKVCache(self.k[layer_id], self.v[layer_id], self.length)

    def advance(self, n: int) -> None:
        """Called by the model after every layer stored ``n`` new positions."""
        self.length += n
