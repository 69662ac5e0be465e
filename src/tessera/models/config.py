"""Model shape configuration, named presets and analytic size/FLOP counts.

The counts here are computed from the shapes alone so that a planner can size a 70B model
without allocating it; tests check they equal the real module's parameter count.

Legend: V vocab, D model dim, L layers, H heads, K kv heads, E head dim (D / H),
F ffn hidden dim, S sequence length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.errors import ConfigError

_POSITIVE_FIELDS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden_dim",
    "max_seq_len",
    "rope_theta",
    "norm_eps",
    "init_std",
)


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-style decoder. Defaults are the `small` preset."""

    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden_dim: int = 688
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # biases on the query/key/value projections (Qwen2); wo and the MLP have none
    dropout: float = 0.0
    init_std: float = 0.02
    num_experts: int = 0  # mixture of experts: experts per MoE layer; 0 = dense model
    moe_every: int = 2  # every moe_every-th block (blocks moe_every-1, 2·moe_every-1, ...) is MoE

    @property
    def head_dim(self) -> int:
        """E = D / H, the per-head width (shared by query and key/value heads)."""
        return self.dim // self.n_heads

    def validate(self) -> "ModelConfig":
        """Raise ConfigError (one sentence) for shapes that cannot build a model; return self."""
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"Model field '{name}' must be positive, got {value!r}.")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"Model dim {self.dim} must be divisible by n_heads {self.n_heads}."
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads {self.n_heads} must be divisible by n_kv_heads {self.n_kv_heads} "
                "so each key/value head serves a whole group of query heads."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"Model dropout must be in [0, 1), got {self.dropout!r}.")
        if self.num_experts < 0 or self.moe_every < 1:
            raise ConfigError(
                f"Model num_experts must be >= 0 and moe_every >= 1, got {self.num_experts} "
                f"and {self.moe_every}."
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"Head dim {self.head_dim} (dim / n_heads) must be even because RoPE rotates "
                "pairs of channels."
            )
        return self

    # ---- analytic counts -------------------------------------------------------------

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` uses the mixture-of-experts feed-forward."""
        return self.num_experts > 0 and layer_id % self.moe_every == self.moe_every - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def _moe_ffn_params(self, moe) -> int:
        """One MoE feed-forward: router (D*E) + E experts (+ residual MLP and its 2-way mixer, + shared)."""
        d, f, n_exp = self.dim, self.ffn_hidden_dim, self.num_experts
        extra = (3 * d * f + 2 * d) if moe is not None and moe.use_residual else 0
        shared = 3 * d * f * moe.num_shared_experts if moe is not None else 0
        return d * n_exp + n_exp * 3 * d * f + extra + shared

    def _layer_params(self) -> int:
        """Parameters of one dense TransformerBlock: attention + SwiGLU + two RMSNorm weights."""
        d, e = self.dim, self.head_dim
        attn = d * (self.n_heads * e) * 2 + d * (self.n_kv_heads * e) * 2  # wq, wo, wk, wv
        if self.qkv_bias:
            attn += (self.n_heads + 2 * self.n_kv_heads) * e
        ffn = 3 * d * self.ffn_hidden_dim  # w1, w3, w2
        return attn + ffn + 2 * d

    def num_params(self, include_embeddings: bool = True, moe=None) -> int:
        """Parameter count of `Transformer(self, moe)`, tied embeddings counted once.

        include_embeddings=False leaves out the token-embedding table (V*D); with tied
        embeddings that table is also the output projection, so it is left out too.
        `moe` (a models.moe.MoEConfig, default None = no residual MLP, no shared experts)
        only matters when num_experts > 0.
        """
        v, d = self.vocab_size, self.dim
        body = self.n_layers * self._layer_params() + d  # + final norm
        ffn = 3 * d * self.ffn_hidden_dim
        body += self.num_moe_layers * (self._moe_ffn_params(moe) - ffn)
        untied_head = 0 if self.tie_embeddings else v * d
        embed = v * d if include_embeddings else 0
        return body + untied_head + embed

    def flops_per_token(self, seq_len: int, moe=None) -> int:
        """Training FLOPs per token: 6*N + 12*L*D*S (PaLM appendix B / Chinchilla convention).

        N counts the weights used in matmuls: every parameter except the input embedding
        lookup, with the output projection (V*D) always included even when tied, because
        the head is a real matmul. The 6 is 2 (multiply-add) x 3 (forward + two backward
        matmuls). 12*L*D*S is the attention score and value matmuls (QK^T and AV, forward
        and backward), which no parameter accounts for; it ignores the causal mask saving.
        """
        n_matmul = self.num_params(include_embeddings=False)
        if self.num_experts:  # a token only runs through its top_k experts (default MoEConfig: 2)
            top_k = moe.top_k if moe is not None else 2
            idle = max(self.num_experts - top_k, 0) * 3 * self.dim * self.ffn_hidden_dim
            n_matmul -= self.num_moe_layers * idle
        if self.tie_embeddings:
            n_matmul += self.vocab_size * self.dim
        return 6 * n_matmul + 12 * self.n_layers * self.dim * seq_len


PRESETS: dict[str, ModelConfig] = {
    # One CPU train step in well under a second; for unit tests.
    "tiny": ModelConfig(
        vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
        ffn_hidden_dim=64, max_seq_len=64,
    ),
    # The defaults: a few hundred steps of 16x128 tokens on 2 CPU cores in minutes.
    "small": ModelConfig(),
    # GPT-2 small shapes (vocab padded to a multiple of 64).
    "124M": ModelConfig(
        vocab_size=50304, dim=768, n_layers=12, n_heads=12, n_kv_heads=12,
        ffn_hidden_dim=2048, max_seq_len=1024, tie_embeddings=True,
    ),
    # Llama-3.2-1B.
    "1B": ModelConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
        ffn_hidden_dim=8192, max_seq_len=2048, tie_embeddings=True, rope_theta=500000.0,
    ),
    # Llama-2-7B.
    "7B": ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
        ffn_hidden_dim=11008, max_seq_len=4096,
    ),
    # Mixture of experts: `small` with 8 experts (half-width SwiGLU) in blocks 1 and 3.
    "moe-small": ModelConfig(ffn_hidden_dim=344, num_experts=8, moe_every=2),
    # Llama-2-70B.
    "70B": ModelConfig(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
        ffn_hidden_dim=28672, max_seq_len=4096,
    ),
}


def model_config(preset: str = "small", **overrides) -> ModelConfig:
    """A validated copy of PRESETS[preset] with the given fields replaced."""
    if preset not in PRESETS:
        raise ConfigError(
            f"Unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}."
        )
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(
            f"Unknown model field(s) {', '.join(unknown)}; valid fields are "
            f"{', '.join(sorted(fields))}."
        )
    return dataclasses.replace(PRESETS[preset], **overrides).validate()
