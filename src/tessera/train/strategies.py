"""What the training step needs to know about the model-parallel strategies, in one place.

The trainer itself stays strategy-agnostic: it asks this module for the loss function (vocabulary-
parallel under tp) and the share of a batch this rank holds (a zig-zag slice of the sequence under cp).
Clipping is ``tessera.grad_norm.clip_grad_norm`` over the layout's axes (``tessera.parallelize.norm_axes``
and ``sharded_axes``).
"""

from __future__ import annotations

import torch

from tessera.models import cross_entropy_sum
from tessera.topology import Topology


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

