"""Build the sharded data-parallel engine a configuration asks for (the one entry point for the trainer
and the benchmarks)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tessera.comm.group import CommGroup
from tessera.precision.config import PrecisionConfig
from tessera.precision.frozen import hold_frozen
from tessera.topology import Topology
from tessera.zero.config import OffloadMode, ZeroConfig
from tessera.zero.offload import OffloadFolder, chunk_elements
from tessera.zero.offload.overlap import overlap_host_copies
from tessera.zero.stage12 import ZeroDataParallel
from tessera.zero.stage3 import FullyShardedDataParallel
from tessera.zero.wrap import Policy, class_policy, config_policy, manual_policy, size_policy


def wrap_policy(cfg: ZeroConfig, block_class: type | None, model: nn.Module | None = None) -> Policy:
    """``block``: each transformer block, and the embedding and output head as units of their own, so
    the root (which stays gathered between forward and backward) holds almost nothing."""
    if cfg.wrap_policy == "block" and block_class is not None:
        head = getattr(model, "output", None)
        by_class = class_policy(block_class, nn.Embedding)
        return lambda m, unwrapped: by_class(m, unwrapped) or (head is not None and m is head)
    if cfg.wrap_policy == "manual":  # the modules zero.wrap_paths / wrap_classes list, else wrap()'s marks
        return config_policy(model, cfg.wrap_paths, cfg.wrap_classes) if cfg.wrap_paths or cfg.wrap_classes \
            else manual_policy
    return size_policy(cfg.min_params)


def shard_model(model: nn.Module, param_groups: list[dict],
                make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], topology: Topology,
                stage: int, zero: ZeroConfig, precision: PrecisionConfig, device: torch.device,
                block_class: type | None = None, norm_axes: dict[str, CommGroup] | None = None,
                param_axes=None, manual: bool = False) -> nn.Module:
    """ZeRO-``stage`` over ``dp_shard`` (replicated over ``dp_replicate``); stage 0 here means DDP with
    fp32 master weights over the whole ``dp`` group (used for mixed precision without sharding).

    The returned engine owns the optimizer (``engine.optimizer``) and is stepped through
    ``engine.clip_grad_norm(max_norm, inv_scale) -> (norm, finite)``, ``engine.step()`` and
    ``engine.zero_grad()``.

    Under context parallelism the cp ranks hold the same parameters and see different tokens, so they
    join the shard group (``dp_shard`` × ``cp``, or ``dp`` × ``cp``). ``norm_axes`` / ``param_axes``:
    the further axes some parameters are split on (tensor parallelism), for the clipping norm.
    ``manual``: reduce only when ``engine.reduce_gradients()`` is called, never from backward hooks (a
    pipeline schedule runs many backwards per step; ZeRO-3 then keeps each unit's full gradient until
    then, and ``zero.reshard_after_forward`` chooses re-gathering per micro-batch or staying gathered).
    """
    shard, replicate = dense_groups(topology, stage)
    return build_engine(model, param_groups, make_optimizer, shard, replicate, stage, zero, precision, device,
                        block_class, norm_axes, param_axes, manual)


def dense_groups(topology: Topology, stage: int) -> tuple[CommGroup, CommGroup]:
    """(shard, replicate) groups of parameters every data-parallel rank holds: ``dp_shard`` × ``dp_replicate``
    for hybrid sharding, else the whole ``dp`` (× ``cp``) and no replicas; stage 0 shards nothing and
    replicates over ``dp`` (× ``cp``)."""
    cp = topology.size("cp") > 1
    dp = topology.group("dp_cp" if cp else "dp")
    if stage == 0:
        return CommGroup.single("dp_shard", topology.ledger, topology.device), dp
    if topology.size("dp_shard") == 1:  # no hybrid layout asked for: shard over every data-parallel rank
        return dp, CommGroup.single("dp_replicate", topology.ledger, topology.device)
    return topology.group("dp_shard_cp" if cp else "dp_shard"), topology.group("dp_replicate")


def build_engine(model: nn.Module, param_groups: list[dict], make_optimizer, shard: CommGroup,
                 replicate: CommGroup, stage: int, zero: ZeroConfig, precision: PrecisionConfig,
                 device: torch.device, block_class: type | None = None, norm_axes=None, param_axes=None,
                 manual: bool = False, frozen=None) -> nn.Module:
    """The engine of ``stage`` over the parameters of ``param_groups`` (a subset of ``model``'s, e.g. only
    the experts), sharded over ``shard`` and replicated over ``replicate``; stage 0 is ZeRO-1's engine
    over a shard group of one (fp32 master weights, gradients all-reduced over ``replicate``).
    ``frozen``: the parameters needing no gradient it holds (default: all of ``model``'s; a LoRA job's
    base weights): never reduced, no master, no optimizer state, held in ``precision.param_dtype`` —
    ZeRO-3 shards them in flats of their own, stages 0-2 leave them whole where they are."""
    mode = OffloadMode(zero.offload)
    offload = torch.device("cpu") if mode != "none" else None  # "disk": the host runs the step, as for "host"
    dtypes = dict(param_dtype=precision.param_dtype, reduce_dtype=precision.grad_reduce_dtype,
                  offload_device=offload)
    extra = dict(norm_axes=norm_axes, param_axes=param_axes)
    if stage <= 2:
        hold_frozen(model.parameters() if frozen is None else frozen, precision.param_dtype)
        engine = ZeroDataParallel(model, param_groups, make_optimizer, shard, replicate, max(stage, 1),
                                  bucket_mb=zero.bucket_mb, hooks=not manual,
                                  allgather_bucket_mb=zero.allgather_bucket_mb, **dtypes, **extra)
        return offload_to_disk(engine, zero) if mode == "disk" else offload_to_host(engine, mode, device)
    engine = FullyShardedDataParallel(model, param_groups, make_optimizer, shard, replicate,
                                      wrap_policy(zero, block_class, model), device,
                                      reshard_after_forward=zero.reshard_after_forward, prefetch=zero.prefetch,
                                      prefetch_params=zero.prefetch_params, max_live_params=zero.max_live_params,
                                      manual=manual, frozen=frozen, **dtypes, **extra)
    return offload_to_disk(engine, zero) if mode == "disk" else offload_to_host(engine, mode, device)


def offload_to_host(engine: nn.Module, mode: OffloadMode, device: torch.device) -> nn.Module:
    """``zero.offload = "host"``: the gradient and parameter copies overlap compute
    (:mod:`tessera.zero.offload.overlap`)."""
    return overlap_host_copies(engine, device) if mode == "host" else engine


def offload_to_disk(engine: nn.Module, zero: ZeroConfig) -> nn.Module:
    """``zero.offload = "disk"``: the engine's fp32 masters and optimizer state move into files of a fresh
    folder of this process under ``zero.offload_dir`` ("": ``offload`` in the working directory; the
    trainer's validation makes it ``<run.out_dir>/offload``), streamed by a
    :class:`~tessera.zero.offload.StreamedAdamW`."""
    rank = engine.update.shard_group.global_rank  # names the folder only
    folder = OffloadFolder(zero.offload_dir or "offload", rank, chunk_elements(zero.offload_chunk_mb))
    engine.optimizer = None  # the in-RAM optimizer's hold on the masters goes before they move
    engine.optimizer = engine.update.offload_to_disk(folder)
    return engine
