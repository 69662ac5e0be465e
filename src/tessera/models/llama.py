"""The single-device reference decoder (Llama-style) that every parallel scheme wraps.

Submodule names are a contract with the parallel passes: `tok_embeddings`, `layers`
(ModuleDict keyed "0".."L-1"), `norm`, `output`. A pipeline stage deletes the layers it
does not own and sets `tok_embeddings` / `norm` / `output` to None; forward copes.

Legend: B batch, S sequence, D model dim, V vocab, E head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.models.config import ModelConfig, model_config
from tessera.models.init import InitSpec, init_parameter
from tessera.models.layers import RMSNorm, TransformerBlock, precompute_rope
from tessera.models.moe import key_positions

# Linear layers whose output is added straight onto the residual stream (GPT-2 scaling).
_RESIDUAL_PROJECTIONS = ("wo", "w2")


class Transformer(nn.Module):
    """Decoder-only transformer: embeddings -> L pre-norm blocks -> RMSNorm -> vocab head."""

    def __init__(self, cfg: ModelConfig, moe=None, seed: int | None = None):
        """`moe`: a models.moe.MoEConfig for the MoE blocks (num_experts > 0); None = its defaults.
        `seed`: of the initial values (see `init_weights`); None draws one from torch's global generator,
        so `torch.manual_seed(s)` before construction still decides the model. Built under
        `torch.device("meta")`, nothing is allocated: each parameter only records its origin."""
        super().__init__()
        if seed is None:  # drawn first: building the layers on a real device draws from the generator too
            seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.cfg = cfg.validate()
        self.moe_cfg = moe
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i, moe) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Non-persistent: derived from cfg, so they stay out of checkpoints and state dicts.
        cos_SE2, sin_SE2 = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos_SE2, persistent=False)
        self.register_buffer("rope_sin", sin_SE2, persistent=False)
        self.init_weights(seed)

    @classmethod
    def from_preset(cls, name: str = "small", **overrides) -> "Transformer":
        """Build from a named preset with field overrides (see `model_config`)."""
        return cls(model_config(name, **overrides))

    def _tie(self) -> None:
        # The same Parameter object: one tensor, one optimizer state, summed gradient.
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, seed: int) -> None:
        """Give every parameter its initial values: a function of (``seed``, its name in the whole model)
        only, drawn chunk by chunk (``tessera.models.init``), so any slice of any layout equals one
        process's. On the meta device the parameters only record that origin.

        Linears and embeddings ~ N(0, init_std); `wo` and `w2` (which write into the
        residual stream) use init_std / sqrt(2 * n_layers) so the residual variance does
        not grow with depth (GPT-2); norm weights are ones; biases zeros. Tied weights are drawn once.
        """
        self._tie()
        for name, p in self.named_parameters():  # tied: the first name (the embedding) only
            init_parameter(p, InitSpec(name, tuple(p.shape), *self._init_kind(name), seed=seed))

    def _init_kind(self, name: str) -> tuple[str, float]:
        """(distribution, std) of parameter ``name`` (see :meth:`init_weights`)."""
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        module = self.get_submodule(owner)
        if isinstance(module, RMSNorm):
            return "ones", 0.0
        if leaf == "bias":
            return "zeros", 0.0
        std = self.cfg.init_std
        if owner.rsplit(".", 1)[-1] in _RESIDUAL_PROJECTIONS:
            std /= math.sqrt(2 * self.cfg.n_layers)
        return "normal", std

    def reset_rope(self, device: torch.device | None = None) -> None:
        """Recompute the RoPE tables in float32 on ``device`` (default: where they are now), e.g. after
        `model.to(torch.bfloat16)` cast them."""
        device = self.rope_cos.device if device is None else torch.device(device)
        with torch.device("cpu"):  # on the CPU whatever the ambient device: the same tables everywhere
            cos_SE2, sin_SE2 = precompute_rope(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        self.rope_cos = cos_SE2.to(device)
        self.rope_sin = sin_SE2.to(device)

    def init_buffers(self, device: torch.device) -> None:
        """The buffers of a model built on the meta device, made on ``device`` (``models.init.materialize``)."""
        self.reset_rope(device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """tokens [B, S] int -> logits [B, S, V].

        On a pipeline stage without `tok_embeddings` the input is hidden states [B, S, D];
        without `norm`/`output` the result is hidden states [B, S, D]. `positions` [S] (int)
        are the absolute positions of the S tokens, for a context-parallel rank that holds
        a shard of a longer sequence; None means 0..S-1.
        `cache`: decoding only (None in training), a ``tessera.generate.KVCache``: the S tokens follow
        the ``cache.length`` already in it (positions default to those after them), each layer attends
        to its cached keys and values, and the cache then holds S more.
        """
        seq_len = tokens.shape[1]
        if cache is not None and positions is None:
            positions = torch.arange(cache.length, cache.length + seq_len, device=self.rope_cos.device)
        last = seq_len if positions is None else int(positions.max()) + 1
        if last > self.cfg.max_seq_len:
            raise ValueError(
                f"Sequence length {last} exceeds the model's max_seq_len "
                f"{self.cfg.max_seq_len}; shorten the batch or raise max_seq_len."
            )
        if self.training and self.cfg.num_experts:  # the routers' noise is keyed by absolute position
            key_positions(self, positions)
        if self.tok_embeddings is not None:
            h_BSD = self.emb_dropout(self.tok_embeddings(tokens))
        else:
            h_BSD = tokens
        if positions is None:
            cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        else:  # the rotary angles of the positions this shard holds
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for name, layer in self.layers.items():
            h_BSD = layer(h_BSD, cos, sin) if cache is None else layer(h_BSD, cos, sin, cache.layer(int(name)))
        if cache is not None:
            cache.advance(seq_len)
        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        if self.output is not None:
            return self.output(h_BSD)  # logits_BSV
        return h_BSD
