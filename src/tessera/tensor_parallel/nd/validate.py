"""What a job with ``tensor_parallel.mode`` 2d / 2.5d / 3d needs, checked before any rank starts.

The grid must fit the tp ranks (q×q, q×q×d, q×q×q) and every weight must cut into equal blocks (weights
are split into q output × q input blocks, 3D output blocks once more by q; a block shared by several
ranks, a norm weight's or a q/k/v bias's, is held once, split by rows over them: ``replicas.py``). Each
failure is one sentence.

LoRA adapters (``[lora]``) are cut like the weights they sit on (``tensor_parallel/adapters.py``): A's
input block is shared by q·d ranks (3D: q²) and held once over them, so they split its r rows; B's output
block is shared like a bias, so an adapted layer's output dimension must split like one (q²·d; 3D: q³).
"""

from __future__ import annotations

import math

from tessera.errors import ConfigError


def grid_sides(mode: str, tp: int, depth: int) -> tuple[int, int]:
    """(q, d) of the grid over ``tp`` ranks: q×q×d (2D: d = 1) or, for 3D, q×q×q (d = q)."""
    if mode == "3d":
        q = round(tp ** (1 / 3))
        if q**3 != tp:
            raise ConfigError(f"tensor_parallel.mode=3d lays the tp ranks out as a q×q×q cube, so parallel.tp "
                              f"must be a cube (8, 27, 64, …), got tp={tp}.")
        return q, q
    d = depth if mode == "2.5d" else 1
    q = math.isqrt(tp // d) if tp % d == 0 else 0
    if q < 1 or q * q * d != tp:
        need = "q×q×tensor_parallel.depth" if mode == "2.5d" else "a square q×q (4, 9, 16, …)"
        raise ConfigError(f"tensor_parallel.mode={mode} lays the tp ranks out as {need}, which parallel.tp={tp}"
                          + (f" with depth={depth}" if mode == "2.5d" else "") + " is not.")
    return q, d


def _divisors(model, mode: str, q: int, d: int, lora=None) -> list[tuple[str, int, int]]:
    """(model field, its value, what must divide it) for every weight block of the grid layout."""
    kv_dim = model.n_kv_heads * model.head_dim
    rows = q * q if mode == "3d" else q * d  # an output dimension splits into q blocks, held once over d
    adapted = set(lora.targets) if lora is not None and lora.enabled else set()
    # q/k/v biases and LoRA B blocks: an O/q block held once over q·d (3D: q²) ranks, like a norm weight
    kv_rows = q * q * d if model.qkv_bias or adapted & {"wk", "wv"} else rows
    ffn_rows = q * q * d if adapted & {"w1", "w3"} else rows
    out = [("n_heads", model.n_heads, q), ("n_kv_heads", model.n_kv_heads, q),
           ("dim", model.dim, q * q * d),  # a norm weight's D/q block held once over q·d (3D: q²) ranks
           ("n_kv_heads×head_dim", kv_dim, kv_rows), ("ffn_hidden_dim", model.ffn_hidden_dim, ffn_rows),
           ("vocab_size", model.vocab_size, rows)]
    if adapted:  # A's input block [r, I/q] held once over the q·d (3D: q²) ranks sharing it
        out.append(("lora.rank", lora.rank, q * q if mode == "3d" else q * d))
    return out


def _refusals(cfg, par) -> list[tuple[bool, str]]:
    """(refused, the sentence's reason and fix) of each pairing the grid layouts do not train."""
    m, lora = cfg.model, getattr(cfg, "lora", None)
    return [
        (cfg.tensor_parallel.sequence_parallel, "sequence parallelism splits the activations 1D tensor "
         "parallelism replicates, and the grid layouts replicate none (each rank already holds a batch × "
         "feature block of every activation); set tensor_parallel.sequence_parallel=false"),
        (par.pp > 1, "pipeline stages are built with 1D tensor parallelism and exchange whole [B, S, D] "
         "activations, not grid blocks; set parallel.pp=1 or tensor_parallel.mode=1d"),
        (par.cp > 1, "the grid layouts keep each sample's whole sequence on a rank (its attention core is "
         "local), which context parallelism splits; set parallel.cp=1 or tensor_parallel.mode=1d"),
        (m.num_experts > 0 or par.ep > 1, "a mixture-of-experts feed-forward routes whole tokens, while a "
         "grid rank holds D/q features of each; set model.num_experts=0 or tensor_parallel.mode=1d"),
        (m.dropout > 0, "the grid layers have no dropout (no random streams agreed over the ranks holding "
         "one activation block); set model.dropout=0 or tensor_parallel.mode=1d"),
        (m.tie_embeddings, "a rank's embedding block and output-head block are different blocks of the "
         "shared table (2D: transposed), so one tensor cannot be both; set model.tie_embeddings=false"),
        (cfg.tensor_parallel.recompute_core_attention, "selective recomputation of the attention core is a "
         "1D option; use checkpointing.mode instead"),
        (lora is not None and lora.enabled and lora.dropout > 0, "the grid layers have no dropout, the LoRA "
         "adapters' included (no random streams agreed over the ranks holding one activation block); set "
         "lora.dropout=0 or tensor_parallel.mode=1d"),
    ]


def validate_nd(cfg, par) -> None:
    """Raise ConfigError (one sentence) when the resolved layout ``par`` with ``cfg.tensor_parallel.mode``
    2d / 2.5d / 3d cannot train ``cfg.model``; nothing for 1D or tp = 1."""
    mode = cfg.tensor_parallel.mode
    if par.tp == 1 or mode == "1d":
        return
    q, d = grid_sides(mode, par.tp, cfg.tensor_parallel.depth)
    for refused, why in _refusals(cfg, par):
        if refused:
            raise ConfigError(f"tensor_parallel.mode={mode} cannot be combined here: {why}.")
    grid = f"{q}×{q}×{d} cube" if mode == "3d" else (f"{q}×{q}×{d} grid" if d > 1 else f"{q}×{q} grid")
    for field, value, k in _divisors(cfg.model, mode, q, d, getattr(cfg, "lora", None)):
        if value % k:
            whose = field if field.startswith("lora.") else f"the model's {field}"
            raise ConfigError(f"tensor_parallel.mode={mode} on a {grid} needs {whose} ({value}) "
                              f"to be divisible by {k}, so every rank holds an equal block of each weight.")
