"""What the training step needs to know about the model-parallel strategies, in one place.

The trainer itself stays strategy-agnostic: it asks this module for the loss function (vocabulary-
parallel under tp), the share of a batch this rank holds (a zig-zag slice of the sequence under cp),
and how to clip gradients so every parameter element counts exactly once in the global norm.
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


def clip_gradients(model: torch.nn.Module, max_norm: float, topology: Topology) -> float:
    """Clip to the global norm over the whole job; returns the norm before clipping.

    One rule for every layout (``tessera.grad_norm``): a gradient split along tp (tensor-parallel
    weights) or ep (experts) adds its squares on every rank of that axis; one replicated along it
    (norm weights, dense weights under ep, experts under tp) only at coordinate 0; then one all-reduce
    per split axis. Under dp × cp every gradient is replicated after reduction: no communication.
    """
    from tessera.grad_norm import clip_pieces, param_pieces
    from tessera.parallelize import norm_axes, sharded_axes

    params = list(model.parameters())
    if not any(p.grad is not None for p in params):
        return 0.0
    device = next(p.grad.device for p in params if p.grad is not None)
    pieces = param_pieces(params, sharded_axes(model, topology))
    return clip_pieces(pieces, max_norm, norm_axes(topology), device)
