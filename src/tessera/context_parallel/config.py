"""Configuration of context parallelism (the ``[context_parallel]`` section)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError

METHODS = ("ring", "ulysses", "ring_self_attention")


@dataclass
class ContextParallelConfig:
    # Which distributed attention runs over the cp group:
    #   "ring"                 ring attention (Liu et al. 2023), online softmax, causal load-balanced
    #   "ulysses"              DeepSpeed-Ulysses (Jacobs et al. 2023), all-to-all sequence <-> heads
    #   "ring_self_attention"  Colossal-AI's ring self-attention (Li et al. 2021), ring Q·K^T then ring A·V
    method: str = "ring"

    def validate(self) -> ContextParallelConfig:
        """Checks that need nothing but this section."""
        if self.method not in METHODS:
            raise ConfigError(
                f"context_parallel.method must be one of {', '.join(METHODS)}, got {self.method!r}."
            )
        return self

    def check_shapes(self, cp: int, seq_len: int | None, n_heads: int, n_kv_heads: int,
                     dropout: float = 0.0) -> None:
        """Raise ConfigError (one sentence) when ``cp`` ranks cannot split this model and sequence.

        ``n_heads`` / ``n_kv_heads`` are the heads one rank holds (after any tensor parallelism);
        ``seq_len`` None skips the sequence check (it is then checked per batch).
        Every method uses the load-balanced ("zig-zag") layout: the sequence is cut into 2·cp
        chunks and rank r holds chunks r and 2·cp−1−r, so seq_len must be divisible by 2·cp.
        """
        self.validate()
        if cp < 1:
            raise ConfigError(f"parallel.cp must be at least 1, got {cp}.")
        if cp == 1:
            return
        if seq_len is not None and seq_len % (2 * cp):
            raise ConfigError(
                f"Sequence length {seq_len} must be divisible by 2·cp = {2 * cp} because each "
                "context-parallel rank holds two equal chunks of it (chunks r and 2·cp−1−r)."
            )
        if self.method == "ulysses" and (n_heads % cp or n_kv_heads % cp):
            raise ConfigError(
                f"Ulysses context parallelism needs cp = {cp} to divide both n_heads = {n_heads} "
                f"and n_kv_heads = {n_kv_heads} (per tensor-parallel rank), because it splits heads "
                "over the cp ranks; use method='ring' or a cp that divides them."
            )
        if dropout > 0.0:
            raise ConfigError(
                f"Context parallelism needs model dropout 0 (got {dropout}) because attention-probability "
                "dropout is not implemented in the distributed attention kernels."
            )
