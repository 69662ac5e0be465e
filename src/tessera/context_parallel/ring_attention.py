"""Ring attention (Liu et al. 2023), causal, on the load-balanced (zig-zag) layout.

Each cp rank holds L = S/cp tokens (chunks r and 2cp−1−r, see `layout.py`) of q, k and v. The key/value
blocks travel round the ring: at step i rank r computes attention of its queries against the block that
started on rank src = (r − i) mod cp and merges it into its running result with the online softmax
(log-sum-exp), while the block for step i+1 is already on the wire. Under the zig-zag layout every step
after the first costs every rank the same half block:
    src == r  (step 0)  both local chunks, causal within them
    src <  r            all L queries × the src's early chunk (c keys), no mask
    src >  r            the late query chunk (c queries) × all L keys of src, no mask
Forward communication: cp−1 sends + receives of this rank's k and v (2·B·L·K·E elements each, in the
input dtype; dk/dv accumulators travel in float32).
Backward communication (hand-written, not autograd): the k/v blocks go round again (cp−1 shifts) and
an accumulator of dk/dv travels with each block (cp shifts, the last one brings it home), so every rank
ends with the gradient of its own k and v. Peak extra memory: two k/v blocks and two dk/dv blocks.

Legend: B batch, H query heads, K kv heads, L local tokens, c = L/2, E head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.context_parallel.blockwise import block_backward, block_forward, merge_into


def ring_shift(send: torch.Tensor, group: CommGroup) -> tuple[torch.Tensor, list]:
    """Post: send ``send`` to the next rank, receive the previous rank's into a new tensor.

    Returns (receive buffer, handles); wait on the handles before reading the buffer."""
    recv = torch.empty_like(send)
    ops = [comm.P2POp("send", send, (group.rank + 1) % group.size),
           comm.P2POp("recv", recv, (group.rank - 1) % group.size)]
    return recv, comm.batch_isend_irecv(ops, group)


def _wait(handles) -> None:
    for h in handles:
        h.wait()


def _regions(step: int, rank: int, n: int, c: int):
    """(query rows, key rows, causal) this rank computes at ``step`` (see the module docstring)."""
    src = (rank - step) % n
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHLE, k_BKLE, v_BKLE, group: CommGroup):
        scale = 1.0 / math.sqrt(q_BHLE.shape[-1])
        n, r, c = group.size, group.rank, q_BHLE.shape[2] // 2
        q32 = q_BHLE.float()
        kv_2BKLE = torch.stack((k_BKLE, v_BKLE))  # on the wire in the input dtype; math in float32
        out_BHLE = lse_BHL = None
        for step in range(n):
            nxt, handles = ring_shift(kv_2BKLE, group) if step < n - 1 else (None, [])
            qs, ks, causal = _regions(step, r, n, c)
            kv32 = kv_2BKLE[:, :, :, ks].float()
            blk_out, blk_lse = block_forward(q32[:, :, qs], kv32[0], kv32[1], scale, causal)
            if out_BHLE is None:
                # copies, because merge_into writes in place: under selective activation checkpointing
                # the first block's matmul output is a cached tensor that the recompute hands back
                out_BHLE, lse_BHL = blk_out.clone(), blk_lse.clone()
            else:
                merge_into(out_BHLE[:, :, qs], lse_BHL[:, :, qs], blk_out, blk_lse)
            _wait(handles)
            kv_2BKLE = nxt
        ctx.group, ctx.scale = group, scale
        ctx.save_for_backward(q_BHLE, k_BKLE, v_BKLE, out_BHLE, lse_BHL)
        return out_BHLE.to(q_BHLE.dtype)

    @staticmethod
    def backward(ctx, dout_BHLE):
        q_BHLE, k_BKLE, v_BKLE, out_BHLE, lse_BHL = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, r, c = group.size, group.rank, q_BHLE.shape[2] // 2
        q32, dout32 = q_BHLE.float(), dout_BHLE.float()
        delta_BHL = (dout32 * out_BHLE).sum(-1)
        dq_BHLE = torch.zeros_like(q32)
        kv_2BKLE = torch.stack((k_BKLE, v_BKLE))
        dkv_2BKLE = torch.zeros_like(kv_2BKLE, dtype=torch.float32)  # accumulator of the block we hold
        dkv_handles: list = []
        for step in range(n):
            nxt, kv_handles = ring_shift(kv_2BKLE, group) if step < n - 1 else (None, [])
            qs, ks, causal = _regions(step, r, n, c)
            kv32 = kv_2BKLE[:, :, :, ks].float()
            dq, dk, dv = block_backward(q32[:, :, qs], kv32[0], kv32[1], dout32[:, :, qs],
                                        lse_BHL[:, :, qs], delta_BHL[:, :, qs], scale, causal)
            dq_BHLE[:, :, qs] += dq
            _wait(dkv_handles)  # the accumulator for this block arrived while we computed
            dkv_2BKLE[0][:, :, ks] += dk
            dkv_2BKLE[1][:, :, ks] += dv
            # pass it on with the block; after the last step it goes home to the block's owner
            dkv_2BKLE, dkv_handles = ring_shift(dkv_2BKLE, group)
            _wait(kv_handles)
            kv_2BKLE = nxt
        _wait(dkv_handles)
        dk_BKLE, dv_BKLE = dkv_2BKLE[0], dkv_2BKLE[1]
        return (dq_BHLE.to(q_BHLE.dtype), dk_BKLE.to(k_BKLE.dtype), dv_BKLE.to(v_BKLE.dtype), None)


def ring_attention(q_BHLE, k_BKLE, v_BKLE, group: CommGroup) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole (zig-zag sharded) sequence."""
    return _RingAttention.apply(q_BHLE, k_BKLE, v_BKLE, group)


class RingAttention(nn.Module):
    """Drop-in `core_attention`: q [B, L, H, E], k/v [B, L, K, E] (local shard) -> y [B, L, H, E].

    Forward: cp−1 ring shifts of k/v. Backward: cp−1 ring shifts of k/v plus cp of dk/dv."""

    def __init__(self, group: CommGroup):
        super().__init__()
        self.group = group

    def forward(self, q_BLHE, k_BLKE, v_BLKE):
        y_BHLE = ring_attention(q_BLHE.transpose(1, 2), k_BLKE.transpose(1, 2).contiguous(),
                                v_BLKE.transpose(1, 2).contiguous(), self.group)
        return y_BHLE.transpose(1, 2)
