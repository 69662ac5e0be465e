"""Which tokens a context-parallel rank holds: the load-balanced ("zig-zag") layout.

Causal attention over a sequence cut into cp contiguous pieces gives the last rank cp times the
work of the first. Instead the sequence is cut into 2·cp equal chunks and rank r holds chunk r and
chunk 2·cp−1−r (an early one and a late one), so every rank attends to the same number of
(query, key) pairs. Every method in this package uses this one layout, so the trainer shards a
batch the same way whichever method is chosen.

Legend: B batch, S global sequence, L = S / cp tokens per rank, c = L / 2 chunk length.
"""

from __future__ import annotations

import torch

from tessera.comm.group import CommGroup


def zigzag_positions(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Absolute positions [L] (int64, increasing) of the tokens cp rank ``rank`` holds."""
    c = seq_len // (2 * cp)
    front = torch.arange(rank * c, (rank + 1) * c, device=device)
    back = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat((front, back))


def shard_sequence(x_BS: torch.Tensor, cp: CommGroup, dim: int = 1) -> torch.Tensor:
    """This rank's [B, L, ...] share of a full-sequence tensor (tokens, labels, a loss mask)."""
    if cp.size == 1:
        return x_BS
    if x_BS.shape[dim] % (2 * cp.size):
        raise ValueError(
            f"Sequence length {x_BS.shape[dim]} must be divisible by 2·cp = {2 * cp.size} to shard it "
            "over the context-parallel ranks."
        )
    pos_L = zigzag_positions(x_BS.shape[dim], cp.rank, cp.size, device=x_BS.device)
    return x_BS.index_select(dim, pos_L)


def unshard_order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Positions [S] in the order the ranks' shards concatenate (rank 0's L tokens first, ...)."""
    return torch.cat([zigzag_positions(seq_len, r, cp, device) for r in range(cp)])
