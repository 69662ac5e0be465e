"""Token-level cross-entropy returned as a SUM plus a token count, never a mean.

Why a sum: with data parallelism and gradient accumulation, each rank / micro-batch holds a
different number of non-ignored tokens. Averaging locally and then averaging the averages
would weight tokens unequally. The trainer instead sums losses everywhere and divides by
the GLOBAL token count (all-reduced across ranks and micro-batches), which gives exactly
the mean over every token of the global batch.

Legend: B batch, S sequence, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_sum(
    logits_BSV: torch.Tensor, targets_BS: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, int]:
    """(sum of per-token losses as a float32 0-d tensor, number of non-ignored tokens).

    Logits are upcast to float32 first: log-softmax over a large vocab in bf16 loses
    precision. Targets equal to `ignore_index` contribute 0 and are not counted.
    """
    vocab = logits_BSV.shape[-1]
    loss_sum = F.cross_entropy(
        logits_BSV.float().reshape(-1, vocab),
        targets_BS.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    n_tokens = int((targets_BS != ignore_index).sum().item())
    return loss_sum, n_tokens
