"""What the training step needs to know about the model-parallel strategies, in one place.

The trainer itself stays strategy-agnostic: it asks this module for the loss function (vocabulary-
parallel under tp), the share of a batch this rank holds (a zig-zag slice of the sequence under cp),
and how to clip gradients so every parameter element counts exactly once in the global norm.
"""

from __future__ import annotations

import torch

from tessera.models import cross_entropy_sum
from tessera.topology import Topology
from tessera.train.optim import clip_grad_norm


def loss_function(topology: Topology):
    """``loss_fn(logits, targets, ignore_index) -> (sum, count)``: tp splits the logits by vocabulary."""
    if topology.size("tp") > 1:
        from tessera.tensor_parallel import TensorParallelLoss

        return TensorParallelLoss(topology.group("tp"))
    return cross_entropy_sum


def shard_batch(batch: tuple[torch.Tensor, torch.Tensor], topology: Topology):
    """This rank's share of an (x_BS, y_BS) micro-batch: its two zig-zag chunks of the sequence under cp
    (labels were shifted on the full sequence, so every target stays next to its input)."""
    if topology.size("cp") == 1:
        return batch
    from tessera.context_parallel import shard_sequence

    cp = topology.group("cp")
    return tuple(shard_sequence(t, cp) for t in batch)


def clip_gradients(model: torch.nn.Module, max_norm: float, topology: Topology) -> float:
    """Clip to the global norm over the whole job; returns the norm before clipping.

    Under dp × cp every gradient is replicated after reduction, so it needs no communication. Under ep
    expert gradients differ per ep rank (summed over ep), dense ones are counted once. Under tp the
    sharded gradients' squares are summed over tp, replicated ones (norm weights) counted once.
    """
    if topology.size("ep") > 1:
        from tessera.moe import clip_grad_norm_moe

        return float(clip_grad_norm_moe(model, max_norm, topology.group("ep")))
    if topology.size("tp") > 1:
        from tessera.tensor_parallel import clip_grad_norm_, grad_norm

        params = list(model.parameters())
        if max_norm > 0:
            return float(clip_grad_norm_(params, max_norm, topology.group("tp")))
        return float(grad_norm(params, topology.group("tp")))
    return clip_grad_norm(model.parameters(), max_norm)


def checkpoint_unsupported(topology: Topology) -> str | None:
    """Why the final checkpoint cannot be written for this layout yet, or None.

    tp and ep ranks hold different tensors under the same parameter names, which a plain
    torch.distributed.checkpoint save would treat as one replicated tensor; layout-independent
    checkpoints (global shapes and offsets) are what issue #7 adds.
    """
    for axis, what in (("tp", "tensor-parallel"), ("ep", "expert-parallel")):
        if topology.size(axis) > 1:
            return (f"final checkpoint skipped: {what} checkpoints (parallel.{axis}>1) are not supported "
                    f"yet; set checkpoint.save_final=false to silence this")
    return None
