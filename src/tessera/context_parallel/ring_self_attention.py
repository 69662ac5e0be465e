"""Colossal-AI's ring self-attention (Li et al. 2021, "Sequence Parallelism"), causal.

Each cp rank holds L = S/cp tokens (the zig-zag layout of `layout.py`). Phase 1 (ring Q·Kᵀ): the k
blocks travel round the ring and each rank fills its [L, S] rows of the score matrix. A causal mask
built from the absolute positions is applied and the softmax taken over all S keys. Phase 2 (ring A·V):
the v blocks travel round the ring and each rank accumulates probabilities × values. Unlike ring
attention, the full [L, S] score rows are materialised and saved (memory O(L·S) per rank, the paper's
cost). Each shift is an autograd function, so backward is autograd's: every ring shift's backward sends
the gradient the opposite way round the ring.
Forward communication: cp−1 shifts of k, then cp−1 shifts of v. Backward: the same shifts of dk and dv.

Legend: B batch, H query heads, K kv heads, L local tokens, S = cp·L, E head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.context_parallel.blockwise import _repeat_heads
from tessera.context_parallel.layout import zigzag_positions


def _shift(x: torch.Tensor, group: CommGroup, step: int) -> torch.Tensor:
    """Send ``x`` ``step`` places forward round the ring (step −1: backward); return what arrives."""
    recv = torch.empty_like(x)
    ops = [comm.P2POp("send", x, (group.rank + step) % group.size),
           comm.P2POp("recv", recv, (group.rank - step) % group.size)]
    for h in comm.batch_isend_irecv(ops, group):
        h.wait()
    return recv


class _RingShift(torch.autograd.Function):
    """Forward: pass ``x`` to the next rank. Backward: pass the gradient to the previous rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x.contiguous(), group, 1)

    @staticmethod
    def backward(ctx, g):
        return _shift(g.contiguous(), ctx.group, -1), None


def ring_self_attention(q_BHLE, k_BKLE, v_BKLE, group: CommGroup) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence; returns [B, H, L, E]."""
    n, r, l = group.size, group.rank, q_BHLE.shape[2]
    n_rep = q_BHLE.shape[1] // k_BKLE.shape[1]
    scale = 1.0 / math.sqrt(q_BHLE.shape[-1])
    # phase 1: score blocks q·k_srcᵀ, ordered by the rank their keys came from
    blocks: list = [None] * n
    k_cur = k_BKLE
    for step in range(n):
        if step:
            k_cur = _RingShift.apply(k_cur, group)
        blocks[(r - step) % n] = q_BHLE @ _repeat_heads(k_cur, n_rep).transpose(-1, -2) * scale
    s_BHLS = torch.cat(blocks, dim=-1)  # key column j·L + t is rank j's t-th token
    q_pos_L = zigzag_positions(n * l, r, n, device=q_BHLE.device)
    k_pos_S = torch.cat([zigzag_positions(n * l, j, n, device=q_BHLE.device) for j in range(n)])
    s_BHLS = s_BHLS.masked_fill(k_pos_S[None, :] > q_pos_L[:, None], float("-inf"))
    p_BHLS = torch.softmax(s_BHLS.float(), dim=-1).to(q_BHLE.dtype)
    # phase 2: out = Σ_src p[:, :, :, src block] · v_src, the cp partial sums added in float32 (in bf16 /
    # fp16 each addition would round again), cast back once
    out_BHLE = None
    v_cur = v_BKLE
    for step in range(n):
        if step:
            v_cur = _RingShift.apply(v_cur, group)
        src = (r - step) % n
        part = (p_BHLS[..., src * l:(src + 1) * l] @ _repeat_heads(v_cur, n_rep)).float()
        out_BHLE = part if out_BHLE is None else out_BHLE + part
    return out_BHLE.to(q_BHLE.dtype)


class RingSelfAttention(nn.Module):
    """Drop-in `core_attention`: q [B, L, H, E], k/v [B, L, K, E] (local shard) -> y [B, L, H, E].

    Forward: cp−1 ring shifts of k, then of v. Backward: cp−1 reverse shifts of dv, then of dk."""

    def __init__(self, group: CommGroup):
        super().__init__()
        self.group = group

    def forward(self, q_BLHE, k_BLKE, v_BLKE):
        y_BHLE = ring_self_attention(q_BLHE.transpose(1, 2), k_BLKE.transpose(1, 2),
                                     v_BLKE.transpose(1, 2), self.group)
        return y_BHLE.transpose(1, 2)
