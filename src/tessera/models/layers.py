"""Building blocks of the Llama-style decoder: RMSNorm, RoPE, GQA attention, block (SwiGLU: feed_forward.py).

Single-device only: nothing here imports torch.distributed. Parallel wrappers later replace
or shard these modules, so attribute and submodule names are part of the contract.

Legend: B batch, S sequence, D model dim, H query heads, K kv heads, E head dim,
F ffn hidden dim. A suffix like `x_BSD` gives a tensor's shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.config import ModelConfig
from tessera.models.feed_forward import FeedForward
from tessera.models.moe import MoEConfig, MoEFeedForward


def rms_normalize(x_BSD: torch.Tensor, eps: float, kernel: str = "reference") -> torch.Tensor:
    """x / rms(x) over the last dim, computed in float32 and returned in x's dtype (bf16/fp16 stay accurate).

    ``kernel`` (``[kernels] rms_norm``): "reference" spells the formula out; "torch" calls ``F.rms_norm`` on
    the same float32 copy (one fused op where the device has one; same value up to rounding)."""
    x32 = x_BSD.float()
    if kernel == "torch":
        normed = F.rms_norm(x32, (x32.shape[-1],), eps=eps)
    else:
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x_BSD)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalised in float32 so bf16/fp16 inputs stay accurate."""

    rms_norm_kernel = "reference"  # set after build by tessera.kernels.apply_kernels, never a model key

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x_BSD, self.eps, self.rms_norm_kernel) * self.weight


# ---- rotary position embeddings ------------------------------------------------------
#
# Layout: "rotate-half" (as in HF Llama / GPT-NeoX), not interleaved pairs. Channel i of
# the first half is paired with channel i + E/2: (x1, x2) -> (x1 cos - x2 sin,
# x1 sin + x2 cos) at angle pos * theta^(-2i/E). Tables are real (cos, sin) of shape
# [S, E/2]; no complex tensors, which some collectives and dtypes do not support.
# Checkpoints from Meta's interleaved layout need their wq/wk rows permuted to match.


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos_SE2, sin_SE2) float32 tables for positions 0..max_seq_len-1."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}.")
    inv_freq_E2 = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    pos_S = torch.arange(max_seq_len, dtype=torch.float64)
    angles_SE2 = torch.outer(pos_S, inv_freq_E2)  # float64 so large positions stay exact
    return angles_SE2.cos().float(), angles_SE2.sin().float()


def apply_rope(x_BSHE: torch.Tensor, cos_SE2: torch.Tensor, sin_SE2: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i+E/2) of x [B, S, H, E] by the per-position angles.

    cos/sin are [S, E/2], already sliced to x's positions (a context-parallel rank passes
    the slice for the positions it holds). Computed in float32, returned in x's dtype.
    """
    half = x_BSHE.shape[-1] // 2
    x1, x2 = x_BSHE.float()[..., :half], x_BSHE.float()[..., half:]
    cos = cos_SE2.float()[None, :, None, :]  # [1, S, 1, E/2] broadcasts over B and H
    sin = sin_SE2.float()[None, :, None, :]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x_BSHE)


def repeat_kv(x_BSKE: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, K, E] -> [B, S, K*n_rep, E]; query head h reads kv head h // n_rep."""
    if n_rep == 1:
        return x_BSKE
    b, s, k, e = x_BSKE.shape
    return x_BSKE[:, :, :, None, :].expand(b, s, k, n_rep, e).reshape(b, s, k * n_rep, e)


def causal_sdpa(q_BSHE: torch.Tensor, k_BTKE: torch.Tensor, v_BTKE: torch.Tensor, gqa: str = "repeat",
                mask_ST: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """SDPA of q [B, S, H, E] over k, v [B, T, K, E] (H a multiple of K) -> y [B, S, H, E]: causal, or
    ``mask_ST`` (True = may attend) when given. ``gqa`` (``[kernels] gqa``): "repeat" repeats the kv heads
    by hand to [B, T, H, E] first (the default every parity test was measured with); "sdpa" hands SDPA the
    K heads with ``enable_gqa=True``, so no repeated copy is made (query head h reads kv head h // (H/K))."""
    n_rep = q_BSHE.shape[2] // k_BTKE.shape[2]
    extra = {}
    if gqa == "sdpa" and n_rep > 1:
        extra["enable_gqa"] = True
    else:
        k_BTKE, v_BTKE = repeat_kv(k_BTKE, n_rep), repeat_kv(v_BTKE, n_rep)
    y_BHSE = F.scaled_dot_product_attention(q_BSHE.transpose(1, 2), k_BTKE.transpose(1, 2),
                                            v_BTKE.transpose(1, 2), attn_mask=mask_ST, dropout_p=dropout,
                                            is_causal=mask_ST is None, **extra)
    return y_BHSE.transpose(1, 2)


class CausalCoreAttention(nn.Module):
    """The softmax(QK^T/sqrt(E))V step of causal attention, on one device (no parameters).

    Kept as its own module so a context-parallel pass can swap it for a distributed one
    (ring attention, Ulysses, ...) without touching the projections around it. Takes the
    post-RoPE q [B, S, H, E] and un-repeated k, v [B, S, K, E]; returns y [B, S, H, E].
    """

    gqa_kernel = "repeat"  # set after build by tessera.kernels.apply_kernels (see causal_sdpa)

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q_BSHE: torch.Tensor, k_BSKE: torch.Tensor, v_BSKE: torch.Tensor,
                q_offset: int = 0) -> torch.Tensor:
        """``q_offset``: the absolute position of q's first row when k, v [B, q_offset + S, K, E] also hold
        the earlier positions (decoding with a KV cache); 0, with k and v as long as q, is training's case."""
        mask_ST = None
        if q_offset:  # query i (position q_offset + i) sees keys 0..q_offset + i; SDPA's is_causal would not
            s, t = q_BSHE.shape[1], k_BSKE.shape[1]
            mask_ST = torch.ones(s, t, dtype=torch.bool, device=q_BSHE.device).tril(diagonal=q_offset)
        return causal_sdpa(q_BSHE, k_BSKE, v_BSKE, self.gqa_kernel, mask_ST,
                           self.dropout if self.training else 0.0)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    `n_heads`, `n_kv_heads` and `head_dim` are read in forward, and head counts are
    inferred with -1 in reshapes, so a tensor-parallel pass can shard wq/wk/wv by rows,
    wo by columns, and set the per-rank head counts on these attributes.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Output ("residual") dropout of the attention branch, applied here as in GPT-2.
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # Replaceable from outside (context parallelism swaps in a distributed core).
        self.core_attention: nn.Module = CausalCoreAttention(cfg.dropout)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """``cache``: None in training; when decoding, this layer's KV cache (``tessera.generate``): its
        ``start`` is the position of x's first token and ``update(k, v)`` stores k, v [B, S, K, E] there
        and returns the keys and values of every position so far, [B, start + S, K, E]."""
        b, s, _ = x_BSD.shape
        q_BSHE = self.wq(x_BSD).view(b, s, -1, self.head_dim)
        k_BSKE = self.wk(x_BSD).view(b, s, -1, self.head_dim)
        v_BSKE = self.wv(x_BSD).view(b, s, -1, self.head_dim)
        q_BSHE, k_BSKE = apply_rope(q_BSHE, cos, sin), apply_rope(k_BSKE, cos, sin)
        if cache is None:
            y_BSHE = self.core_attention(q_BSHE, k_BSKE, v_BSKE)
        else:
            start = cache.start
            k_BTKE, v_BTKE = cache.update(k_BSKE, v_BSKE)  # T = start + S
            y_BSHE = self.core_attention(q_BSHE, k_BTKE, v_BTKE, q_offset=start)
        y_BSD = y_BSHE.reshape(b, s, -1)  # -1 = local H*E under TP
        return self.resid_dropout(self.wo(y_BSD))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + dropout(ffn(norm(h)))."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, moe=None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.is_moe_layer(layer_id):  # mixture of experts (models/moe.py) with `moe`: MoEConfig
            moe_cfg = moe if moe is not None else MoEConfig()
            self.feed_forward = MoEFeedForward(cfg.dim, cfg.ffn_hidden_dim, cfg.num_experts, moe_cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)
        # Attention drops its own output; this drops the FFN branch before the residual add.
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """``cache``: this layer's KV cache when decoding (see Attention.forward); None in training."""
        extra = () if cache is None else (cache,)  # training calls attention exactly as before
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), cos, sin, *extra)
        return h_BSD + self.resid_dropout(self.feed_forward(self.ffn_norm(h_BSD)))
