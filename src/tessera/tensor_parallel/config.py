"""TensorParallelConfig: how the ``tp`` ranks split a model, checked before any rank starts."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError

MODES = ("1d", "2d", "2.5d", "3d")


@dataclass
class TensorParallelConfig:
    """Options of tensor parallelism (the degree itself is ``ParallelConfig.tp``)."""

    # Megatron sequence parallelism: norms and dropout run on a 1/tp slice of the sequence, and each
    # all-reduce at a region boundary becomes an all-gather + a reduce-scatter (same bytes, 1/tp activations).
    sequence_parallel: bool = False
    # "1d" is Megatron's scheme; "2d"/"2.5d"/"3d" are Colossal-AI's grids (tensor_parallel.nd, whole model).
    mode: str = "1d"
    # Depth d of the q×q×d grid of 2.5D tensor parallelism (ignored by the other modes).
    depth: int = 1
    # Selective recomputation (Korthikanti et al. 2022): recompute the attention core in backward.
    recompute_core_attention: bool = False
    # Seed of the dropout streams; tp ranks must agree on it (the split stream adds the tp rank to it).
    seed: int = 1234

    def validate(self, tp: int = 1, model=None, seq_len: int | None = None) -> TensorParallelConfig:
        """Raise ConfigError (one sentence) when ``tp`` cannot split ``model`` (a ModelConfig); return self."""
        if self.mode not in MODES:
            raise ConfigError(f"tensor_parallel.mode must be one of {', '.join(MODES)}, got {self.mode!r}.")
        if self.depth < 1:
            raise ConfigError(f"tensor_parallel.depth must be a positive integer, got {self.depth}.")
        if tp < 1:
            raise ConfigError(f"parallel.tp must be a positive integer, got {tp}.")
        if model is not None and self.mode == "1d":
            for field in ("n_heads", "n_kv_heads", "ffn_hidden_dim"):
                value = getattr(model, field)
                if value % tp:
                    raise ConfigError(
                        f"parallel.tp={tp} must divide the model's {field} ({value}) so every tensor-parallel "
                        f"rank holds whole heads and an equal slice of the MLP."
                    )
        if self.sequence_parallel and seq_len is not None and seq_len % tp:
            raise ConfigError(
                f"with tensor_parallel.sequence_parallel the sequence length {seq_len} must be divisible by "
                f"parallel.tp={tp}, since each rank holds an equal slice of the sequence."
            )
        return self
