"""The one place that knows the order in which strategies are applied to a model.

Order (torchtitan's, extended): pipeline split → tensor parallel (+ sequence parallel) → context
parallel → expert parallel → activation checkpointing → mixed precision → data parallel / ZeRO.
Each strategy composes with data parallelism; the pairings among pp, tp/cp, ep and ZeRO that are not
composed yet are rejected by :func:`validate_composition` before any rank starts, with a sentence saying
so. Pipeline parallelism is applied by the trainer (``tessera.train.pipeline_step``), since it changes the
step itself rather than the model.

Gradient convention: data-parallel gradients are *summed* over ranks, so the training loss on each
rank must already be divided by the global number of tokens in the step (the trainer does this); that
keeps the result identical to one process however tokens are spread over ranks and micro-batches.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.data_parallel import DDPConfig, DistributedDataParallel
from tessera.errors import ConfigError
from tessera.precision import PrecisionConfig
from tessera.recompute import RecomputeConfig, apply_checkpointing, transformer_blocks
from tessera.topology import Topology
from tessera.zero import FullyShardedDataParallel, ZeroConfig, ZeroDataParallel
from tessera.zero.build import shard_model

def _reject(what: str, fix: str) -> None:
    raise ConfigError(f"{what} is not supported in this version of tessera; {fix}")


def validate_composition(cfg) -> None:
    """Reject strategy pairings this version cannot train; ``cfg`` is a JobConfig (degrees resolved or not)."""
    par = cfg.parallel
    mixed = cfg.precision.dtype != "fp32" or cfg.precision.reduce_dtype not in ("", "fp32")
    model_par = {"pp": par.pp, "tp": par.tp, "cp": par.cp, "ep": par.ep}
    if par.pp > 1:
        if cfg.model.num_experts:
            _reject("pipeline parallelism of a mixture-of-experts model", "set parallel.pp=1")
        for axis in ("tp", "cp", "ep"):
            if model_par[axis] > 1:
                _reject(f"pipeline parallelism together with parallel.{axis}>1", f"set parallel.{axis}=1")
        if par.zero_stage > 0 or mixed or cfg.checkpointing.mode != "none":
            _reject("pipeline parallelism together with ZeRO, mixed precision or [checkpointing]",
                    "use parallel.zero_stage=0, precision.dtype=fp32, checkpointing.mode=none "
                    "(pipeline.recompute re-materialises stages)")
    if par.ep > 1 and (par.tp > 1 or par.cp > 1):
        _reject("expert parallelism together with tensor or context parallelism", "set parallel.tp=1 and parallel.cp=1")
    if (par.tp > 1 or par.cp > 1 or par.ep > 1) and (par.zero_stage > 0 or mixed):
        _reject("ZeRO or mixed precision together with tensor, context or expert parallelism",
                "use parallel.zero_stage=0 and precision.dtype=fp32")
    if par.tp > 1 and cfg.tensor_parallel.mode != "1d":
        _reject(f"training with tensor_parallel.mode={cfg.tensor_parallel.mode!r} (those layers are a library)",
                "use tensor_parallel.mode=1d")


def data_parallel_group(topology: Topology):
    """The ranks that hold the same parameters and see different tokens: dp, times cp when cp > 1."""
    return topology.group("dp_cp")


def parallelize(model: nn.Module, topology: Topology, ddp: DDPConfig, *, zero: ZeroConfig | None = None,
                precision: PrecisionConfig | None = None, recompute: RecomputeConfig | None = None,
                param_groups: list[dict] | None = None, make_optimizer=None, tensor_parallel=None,
                context_parallel=None, device: torch.device = torch.device("cpu")) -> nn.Module:
    """Apply every strategy the topology asks for to ``model`` (in place where possible).

    Tensor parallelism (+SP), then context parallelism, then activation checkpointing, then expert
    parallelism, or mixed precision and ZeRO (``parallel.zero_stage`` ≥ 1, or low precision, which needs
    fp32 master weights), or else DDP over dp × cp. A sharded engine owns the optimizer, built by
    ``make_optimizer(groups)`` over master shards of ``param_groups`` (see :func:`is_sharded`).
    """
    if topology.size("tp") > 1:
        from tessera.tensor_parallel import TensorParallelConfig, apply_tensor_parallel

        apply_tensor_parallel(model, topology.group("tp"), tensor_parallel or TensorParallelConfig())
    if topology.size("cp") > 1:
        from tessera.context_parallel import ContextParallelConfig, apply_context_parallel

        apply_context_parallel(model, topology.group("cp"), context_parallel or ContextParallelConfig())
    if recompute is not None:
        apply_checkpointing(transformer_blocks(model), recompute)
    if topology.size("ep") > 1:  # experts sharded over ep; dense grads over dp, expert grads over edp
        from tessera.moe import expert_parallelize

        return expert_parallelize(model, topology)
    precision = precision or PrecisionConfig()
    stage = topology.config.zero_stage
    if stage > 0 or precision.mixed or precision.grad_reduce_dtype != precision.param_dtype:
        from tessera.models.layers import TransformerBlock

        return shard_model(model, param_groups, make_optimizer, topology, stage, zero or ZeroConfig(),
                           precision, device, block_class=TransformerBlock)
    dp = data_parallel_group(topology)
    if dp.size > 1:
        model = DistributedDataParallel(
            model, dp, bucket_mb=ddp.bucket_mb, find_unused_parameters=ddp.find_unused_parameters,
            reduce_op="sum",
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The single-device model inside any wrapper ``parallelize`` added."""
    from tessera.moe import ExpertDataParallel

    while isinstance(model, (DistributedDataParallel, ZeroDataParallel, FullyShardedDataParallel,
                             ExpertDataParallel)):
        model = model.module
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a ZeRO / master-weight engine: it owns the optimizer and is stepped through
    ``clip_grad_norm(max_norm, inv_scale) -> (norm, finite)``, ``step()`` and ``zero_grad()``."""
    return isinstance(model, (ZeroDataParallel, FullyShardedDataParallel))
