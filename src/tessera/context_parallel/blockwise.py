"""Attention over one (query block, key/value block) pair, with its log-sum-exp, and the online-softmax
merge of partial results; plus the matching hand-written backward. Pure math, no communication.

Layout here is heads-first, float32: q [B, H, Q, E], k / v [B, K, T, E] with K kv heads (query head h
reads kv head h // (H / K)), out [B, H, Q, E], lse [B, H, Q] = log Σ_t exp(q·k_t · scale).
"""

from __future__ import annotations

import torch

from tessera.models.layers import repeat_kv


def _repeat_heads(x_BKTE: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, K, T, E] -> [B, K·n_rep, T, E] (query head h reads kv head h // n_rep): the model's
    ``repeat_kv`` on the sequence-first view, returned heads-first (a strided view; matmul takes it)."""
    return repeat_kv(x_BKTE.transpose(1, 2), n_rep).transpose(1, 2)


def _fold_heads(g_BHTE: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Gradient of `_repeat_heads`: sum the n_rep query-head copies back onto each kv head."""
    b, h, t, e = g_BHTE.shape
    if h == n_kv:
        return g_BHTE
    return g_BHTE.view(b, n_kv, h // n_kv, t, e).sum(2)


def _scores(q_BHQE, k_BKTE, scale: float, causal: bool) -> torch.Tensor:
    """Scaled scores [B, H, Q, T]; causal means query i sees keys 0..i of the same block (Q == T)."""
    k_BHTE = _repeat_heads(k_BKTE, q_BHQE.shape[1] // k_BKTE.shape[1])
    s_BHQT = q_BHQE @ k_BHTE.transpose(-1, -2) * scale
    if causal:
        q_len, t_len = s_BHQT.shape[-2:]
        mask_QT = torch.ones(q_len, t_len, dtype=torch.bool, device=s_BHQT.device).triu(1)
        s_BHQT = s_BHQT.masked_fill(mask_QT, float("-inf"))
    return s_BHQT


def block_forward(q_BHQE, k_BKTE, v_BKTE, scale: float, causal: bool):
    """(out [B, H, Q, E], lse [B, H, Q]) of softmax attention of q over this one key/value block."""
    s_BHQT = _scores(q_BHQE, k_BKTE, scale, causal)
    lse_BHQ = torch.logsumexp(s_BHQT, dim=-1)
    p_BHQT = torch.exp(s_BHQT - lse_BHQ[..., None])
    out_BHQE = p_BHQT @ _repeat_heads(v_BKTE, q_BHQE.shape[1] // v_BKTE.shape[1])
    return out_BHQE, lse_BHQ


def merge_into(out_BHQE, lse_BHQ, blk_out_BHQE, blk_lse_BHQ) -> None:
    """Online softmax, in place: (out, lse) ← the attention over both key sets.

    out = (out·e^lse + blk·e^blk_lse) / (e^lse + e^blk_lse), written with the new lse so nothing overflows.
    """
    new_lse = torch.logaddexp(lse_BHQ, blk_lse_BHQ)
    out_BHQE.mul_(torch.exp(lse_BHQ - new_lse)[..., None])
    out_BHQE.add_(blk_out_BHQE * torch.exp(blk_lse_BHQ - new_lse)[..., None])
    lse_BHQ.copy_(new_lse)


def block_backward(q_BHQE, k_BKTE, v_BKTE, dout_BHQE, lse_BHQ, delta_BHQ, scale: float, causal: bool):
    """(dq, dk, dv) of one block's share of the attention, given the FINAL lse and delta = Σ_E dout·out.

    With p = exp(s − lse) the block's probabilities under the full softmax:
    dv = pᵀ·dout, ds = p ∘ (dout·vᵀ − delta), dq = ds·k·scale, dk = dsᵀ·q·scale.
    """
    n_kv = k_BKTE.shape[1]
    n_rep = q_BHQE.shape[1] // n_kv
    p_BHQT = torch.exp(_scores(q_BHQE, k_BKTE, scale, causal) - lse_BHQ[..., None])
    dv_BHTE = p_BHQT.transpose(-1, -2) @ dout_BHQE
    dp_BHQT = dout_BHQE @ _repeat_heads(v_BKTE, n_rep).transpose(-1, -2)
    ds_BHQT = p_BHQT * (dp_BHQT - delta_BHQ[..., None])
    dq_BHQE = ds_BHQT @ _repeat_heads(k_BKTE, n_rep) * scale
    dk_BHTE = ds_BHQT.transpose(-1, -2) @ q_BHQE * scale
    return dq_BHQE, _fold_heads(dk_BHTE, n_kv), _fold_heads(dv_BHTE, n_kv)
