"""The one place that knows the order in which strategies are applied to a model.

Order (torchtitan's, extended): pipeline split → tensor parallel (+ sequence parallel) → context
parallel → expert parallel → activation checkpointing → mixed precision → data parallel / ZeRO.
This version has data parallelism; the other axes are rejected at validation, before any rank starts,
with a sentence saying so.

Gradient convention: data-parallel gradients are *summed* over ranks, so the training loss on each
rank must already be divided by the global number of tokens in the step (the trainer does this); that
keeps the result identical to one process however tokens are spread over ranks and micro-batches.
"""

from __future__ import annotations

from torch import nn

from tessera.data_parallel import DDPConfig, DistributedDataParallel
from tessera.errors import ConfigError
from tessera.topology import ParallelConfig, Topology

_NOT_YET = {
    "pp": "pipeline parallelism",
    "tp": "tensor parallelism",
    "cp": "context parallelism",
    "ep": "expert parallelism",
}


def validate_composition(parallel: ParallelConfig) -> None:
    """Reject layouts this version cannot train; ``parallel`` is resolved (no -1 left)."""
    for axis, what in _NOT_YET.items():
        degree = getattr(parallel, axis)
        if degree > 1:
            raise ConfigError(
                f"parallel.{axis}={degree} asks for {what}, which this version of tessera does not "
                f"provide yet; set parallel.{axis}=1"
            )


def parallelize(model: nn.Module, topology: Topology, ddp: DDPConfig) -> nn.Module:
    """Apply every strategy the topology asks for to ``model`` (in place where possible)."""
    validate_composition(topology.config)
    dp = topology.group("dp")
    if dp.size > 1:
        model = DistributedDataParallel(
            model, dp, bucket_mb=ddp.bucket_mb, find_unused_parameters=ddp.find_unused_parameters,
            reduce_op="sum",
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The single-device model inside any wrapper ``parallelize`` added."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model
