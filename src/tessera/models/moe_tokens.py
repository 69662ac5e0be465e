"""What an MoE router is told about its tokens: their names, for the training noise, and which are padding.

Noise. The router's training noise is a function of the token, not of the device that routes it.

Noisy gating ("jitter", "rsample") needs one random number per (token, column). Drawn from torch's
random state, the numbers would depend on the layout: every rank is seeded alike, so two data-parallel
replicas would draw the same numbers for different tokens, and N ranks would not equal one process.
Instead each number is a counter-based hash of

    (run seed, MoE layer index, the token's row in the run's sample order, its position in the row, column)

so a token gets the same noise whatever the layout: data parallelism (rows), context parallelism (a rank
holds positions of a longer row), micro-batching and accumulation (rows again), expert and tensor
parallelism (the router is replicated; every rank computes the same numbers). The row counts samples
over the whole run (``WindowSampler``'s order), so it also tells one step from the next, and a resumed
run draws what an uninterrupted one would. Recomputation (activation checkpointing) redraws the same
numbers: the key is a function of the token only.

The hash is 32-bit "lowbias32" (integer xor-shift-multiply, a bijection on 32 bits) evaluated in int64
with the multiplications split in 16-bit halves so nothing overflows: plain tensor arithmetic on any
device, a few elementwise passes over [T, W].

The trainer marks each micro-batch with :func:`key_tokens` before its forward (a pipeline's stages before
each forward and backward of it: ``tessera.train.pipeline_keys``); a model used without a key (library
use, one process) keeps drawing its noise from torch's random state.

Padding. A row's tail of uncounted targets (fine-tuning examples, length buckets) is padding: routed
nowhere, it takes no expert capacity and no part in the routing losses or counters. A prompt's uncounted
targets come before counted ones, so they are real tokens. Under context parallelism a rank holds chunks
of each row, so the decision is made over the whole routing group (:func:`route_padding_nowhere`).

Legend: B rows, L positions per row on this device, T = B·L tokens, W columns (D for jitter, E for rsample).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


@dataclass
class TokenKey:
    """Where a layer's micro-batch sits in the run: enough to name each of its tokens."""

    seed: int  # the run's seed
    layer: int  # index of the transformer block holding the MoE layer
    first_row: int  # the micro-batch's first row, counted over the run's samples (rows are consecutive)
    positions_L: torch.Tensor | None = None  # absolute positions of the L tokens per row (None: 0..L-1)


def _mul32(x, c: int):
    """(x · c) mod 2³² for 0 ≤ x, c < 2³², in int64 without overflow (c split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """lowbias32: a well-mixing bijection of 32-bit integers (Python ints or int64 tensors in [0, 2³²))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def token_uniform(key: TokenKey, batch: int, tokens: int, width: int, device) -> torch.Tensor:
    """[T, W] float32 uniform in (0, 1): one number per (token, column) of ``key``'s micro-batch.

    Tokens are row-major (b·L + l) as the router sees them (``x_BSD`` flattened)."""
    local = tokens // max(batch, 1)
    base = mix32(mix32(mix32(key.seed & _M32) ^ (key.seed >> 32) & _M32) ^ (key.layer & _M32))
    rows_B = torch.arange(batch, device=device, dtype=torch.int64) + key.first_row
    pos_L = (torch.arange(local, device=device, dtype=torch.int64) if key.positions_L is None
             else key.positions_L.to(device=device, dtype=torch.int64))
    h_B = mix32(rows_B.bitwise_and(_M32) ^ base)
    h_T = mix32(h_B[:, None] ^ pos_L[None, :]).reshape(-1, 1)
    col_W = torch.arange(width, device=device, dtype=torch.int64)[None, :]
    h_TW = mix32((h_T + _mul32(col_W, 0x9E3779B9)) & _M32)
    return ((h_TW >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32, never 0 or 1


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str, fallback: int) -> int:
    """The block index in a module name (``layers.3.feed_forward``, any wrapper prefix); else ``fallback``."""
    found = _LAYER_INDEX.findall(name)
    return int(found[-1]) if found else fallback


def real_tokens(counted_BS: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: the tokens that are not padding. Padding is a row's tail of uncounted targets (a
    prompt's uncounted targets come before counted ones): a token is real when a target at or after it counts."""
    return counted_BS.flip(1).cumsum(1).flip(1) > 0


def route_padding_nowhere(group_GK: torch.Tensor, batch: int, n_exp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(choices [G, K] with padding's set to n_exp, no expert; real_G) from choices shifted by n_exp + 1
    where the target is uncounted, in group token order (b·S + s)."""
    counted_G = group_GK[:, 0] <= n_exp
    real_G = real_tokens(counted_G.view(batch, -1)).reshape(-1)
    return (group_GK % (n_exp + 1)).masked_fill(~real_G[:, None], n_exp), real_G
