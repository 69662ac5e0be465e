"""What the training step needs to know about the model-parallel strategies, in one place.

The trainer itself stays strategy-agnostic: it asks this module for the loss function (vocabulary-
parallel under tp), the share of a step's batch this rank holds (a zig-zag slice of the sequence under cp;
a batch block under 2D / 2.5D / 3D tensor parallelism) and the group of ranks that hold different tokens
(over which the token count and the loss are summed). Clipping is ``tessera.grad_norm.clip_grad_norm``
over the layout's axes (``tessera.parallelize.norm_axes`` and ``sharded_axes``).

``model`` is the unwrapped model after :func:`tessera.parallelize.parallelize`: 2D / 2.5D / 3D tensor
parallelism leaves its layout on it (``nd_layout``), which decides these three.
"""

from __future__ import annotations

import torch

from tessera.comm.group import CommGroup
from tessera.models import cross_entropy_sum
from tessera.parallelize import data_parallel_group
from tessera.topology import Topology
from tessera.train.step import IGNORE_INDEX

Batch = tuple[torch.Tensor, torch.Tensor]


def _nd_layout(model):
    return getattr(model, "nd_layout", None) if model is not None else None


def loss_function(topology: Topology, model=None):
    """``loss_fn(logits, targets, ignore_index) -> (sum, count)``: tp splits the logits by vocabulary
    (over the whole tp group in 1D, over the ranks holding the same logits rows in 2D / 2.5D / 3D)."""
    layout = _nd_layout(model)
    if layout is not None or topology.size("tp") > 1:
        from tessera.tensor_parallel import TensorParallelLoss

        return TensorParallelLoss(layout.vocab_group if layout is not None else topology.group("tp"))
    return cross_entropy_sum


def tokens_group(topology: Topology, model=None) -> CommGroup:
    """The ranks holding different tokens of a step (the token count and the loss are summed over them):
    dp × cp, times the grid's batch blocks under 2D / 2.5D / 3D tensor parallelism (a new group:
    collective over the world, call once)."""
    layout = _nd_layout(model)
    if layout is None:
        return data_parallel_group(topology)
    from tessera.tensor_parallel.nd.model import tokens_group as nd_tokens_group

    return nd_tokens_group(topology, layout)


def shard_batch(batch: Batch, topology: Topology):
    """This rank's share of an (x_BS, y_BS) micro-batch: its two zig-zag chunks of the sequence under cp
    (labels were shifted on the full sequence, so every target stays next to its input)."""
    if topology.size("cp") == 1:
        return batch
    from tessera.context_parallel import shard_sequence

    cp = topology.group("cp")
    return tuple(shard_sequence(t, cp) for t in batch)


def shard_step(batches: list[Batch], topology: Topology, model=None) -> list[Batch]:
    """This rank's micro-batches of a step given the micro-batches of its data-parallel rank: each one's
    :func:`shard_batch`, or under 2D / 2.5D / 3D its batch block of the step's samples (padded with
    ignored targets to a multiple of the blocks; ``tessera.tensor_parallel.nd.model.batch_share``)."""
    layout = _nd_layout(model)
    if layout is None:
        return [shard_batch(b, topology) for b in batches]
    from tessera.tensor_parallel.nd.model import batch_share

    return batch_share(batches, layout, IGNORE_INDEX)
