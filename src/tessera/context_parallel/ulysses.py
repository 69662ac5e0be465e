"""DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all from sequence shards to head shards and back.

Each cp rank holds L = S/cp tokens of every head. One all-to-all gives it all S tokens of H/cp query
heads (and K/cp kv heads); it runs ordinary causal attention on them, and a second all-to-all returns
the output to sequence shards. The zig-zag layout (see `layout.py`) is undone after the first all-to-all
and redone before the second, so the dense core sees positions 0..S−1 in order.
Forward communication: all-to-all of q, k and v in, of y out (each moves (cp−1)/cp of the tensor).
Backward communication: the same all-to-alls in reverse (y's gradient in, q/k/v gradients out).

Legend: B batch, S = cp·L sequence, L local tokens, H query heads, K kv heads, E head dim, n = cp.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.context_parallel.layout import unshard_order


def _seq_to_heads(x_BLHE: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """[B, L, H, E] (my tokens, all heads) -> [B, n·L, H/n, E] (everyone's tokens in rank order, my heads)."""
    b, l, h, e = x_BLHE.shape
    n = group.size
    send_nBLhE = x_BLHE.reshape(b, l, n, h // n, e).permute(2, 0, 1, 3, 4).contiguous()
    recv_nBLhE = torch.empty_like(send_nBLhE)  # recv[j] = rank j's tokens of my heads
    comm.all_to_all(recv_nBLhE, send_nBLhE, group)
    return recv_nBLhE.permute(1, 0, 2, 3, 4).reshape(b, n * l, h // n, e)


def _heads_to_seq(y_BShE: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Inverse of `_seq_to_heads`: [B, n·L, H/n, E] -> [B, L, H, E]."""
    b, s, hl, e = y_BShE.shape
    n = group.size
    send_nBLhE = y_BShE.reshape(b, n, s // n, hl, e).permute(1, 0, 2, 3, 4).contiguous()
    recv_nBLhE = torch.empty_like(send_nBLhE)  # recv[j] = my tokens of rank j's heads
    comm.all_to_all(recv_nBLhE, send_nBLhE, group)
    return recv_nBLhE.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * hl, e)


class _SeqToHeads(torch.autograd.Function):
    """Forward: all-to-all sequence shards -> head shards. Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x_BLHE, group):
        ctx.group = group
        return _seq_to_heads(x_BLHE, group)

    @staticmethod
    def backward(ctx, g_BShE):
        return _heads_to_seq(g_BShE.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """Forward: all-to-all head shards -> sequence shards. Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, y_BShE, group):
        ctx.group = group
        return _heads_to_seq(y_BShE, group)

    @staticmethod
    def backward(ctx, g_BLHE):
        return _seq_to_heads(g_BLHE.contiguous(), ctx.group), None


class UlyssesAttention(nn.Module):
    """Drop-in `core_attention`: q [B, L, H, E], k/v [B, L, K, E] (local shard) -> y [B, L, H, E].

    ``core`` is the single-device causal core it wraps (the one it replaces in the model), which
    then runs on all S tokens of H/cp heads.
    Forward: 3 all-to-alls in (q, k, v), 1 out (y). Backward: 1 in (dy), 3 out (dq, dk, dv)."""

    def __init__(self, group: CommGroup, core: nn.Module):
        super().__init__()
        self.group = group
        self.core = core

    def forward(self, q_BLHE, k_BLKE, v_BLKE):
        n = self.group.size
        q_BShE, k_BSkE, v_BSkE = (_SeqToHeads.apply(t, self.group) for t in (q_BLHE, k_BLKE, v_BLKE))
        s = q_BShE.shape[1]
        shard_order_S = unshard_order(s, n, device=q_BShE.device)  # position of each gathered row
        natural_S = torch.argsort(shard_order_S)  # gathered row holding position 0, 1, ...
        q_BShE, k_BSkE, v_BSkE = (t.index_select(1, natural_S) for t in (q_BShE, k_BSkE, v_BSkE))
        y_BShE = self.core(q_BShE, k_BSkE, v_BSkE).index_select(1, shard_order_S)
        return _HeadsToSeq.apply(y_BShE.contiguous(), self.group)
