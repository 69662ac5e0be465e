"""Every strategy around the job's meta model, once, before training: what the trainer then only uses.

Three ways to assemble, picked by the config:

- ``ddp.mode`` other than "allreduce": a data-parallel mode (local SGD, parameter servers, DataParallel;
  ``tessera.train.dp_modes``) replaces the data-parallel wrapper and holds the optimizer; with
  ``parallel.pp`` > 1 the pipeline step runs the stages and the mode is built over them (both set);
- ``parallel.pp`` > 1: the pipeline step (``tessera.train.pipeline_step``) keeps this rank's stages,
  puts each through the model-side strategies and owns their optimizer;
- otherwise ``tessera.parallelize`` (tp, cp, ep, DDP / ZeRO, precision, recompute, kernels), and the
  optimizer: a sharded engine's over its fp32 master shards, or the job's over the model's parameters.

Every strategy allocates what it claimed on the meta model; :func:`assemble` checks that nothing is left
on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tessera.models.init import check_materialized
from tessera.parallelize import is_sharded, parallelize
from tessera.topology import Topology
from tessera.train.config import JobConfig
from tessera.train.dp_modes.assemble import assemble_mode, assemble_pipelined_mode
from tessera.train.optim import build_optimizer, optimizer_factory, param_groups
from tessera.zero.config import ZeroConfig

if TYPE_CHECKING:  # the pipeline step is imported only where a job has pp > 1
    from tessera.train.dp_modes.base import DataParallelMode
    from tessera.train.pipeline_step import PipelineStep


@dataclass
class Assembled:
    """What the trainer trains with. ``pipe`` runs forward / backward / evaluation when set; ``mode`` (when
    set) does the update, also under a pipeline (then ``pipe`` reduces nothing over data parallelism)."""

    model: nn.Module  # what forward / backward / evaluation run (a wrapper, or the core itself)
    core: nn.Module  # the parameters that are the training state (the pipeline: this rank's stages)
    engine: object | None  # a ZeRO / master-weight engine holding the optimizer, or None
    pipe: PipelineStep | None  # parallel.pp > 1: this rank's stages and their schedule, or None
    mode: DataParallelMode | None  # ddp.mode other than "allreduce", or None
    optimizer: torch.optim.Optimizer  # the one the learning-rate schedule drives


def assemble(cfg: JobConfig, topology: Topology, core: nn.Module, device: torch.device,
             zero_cfg: ZeroConfig) -> Assembled:
    """The strategies of ``cfg`` around ``core`` (the meta model), materialised on ``device``.
    ``zero_cfg``: ``cfg.zero`` as the engines take it (the disk offload folder filled in)."""
    if cfg.ddp.mode != "allreduce" and topology.size("pp") > 1:  # the mode per stage, over its replicas
        pipe, mode = assemble_pipelined_mode(cfg, topology, core, device, zero_cfg)
        parts = Assembled(model=pipe.module, core=pipe.module, engine=mode.engine, pipe=pipe, mode=mode,
                          optimizer=mode.optimizer)
    elif cfg.ddp.mode != "allreduce":  # local SGD, parameter servers, DataParallel: exchange at the step
        mode = assemble_mode(cfg, topology, core, device)
        parts = Assembled(model=mode.model, core=core, engine=mode.engine, pipe=None, mode=mode,
                          optimizer=mode.optimizer)
    elif topology.size("pp") > 1:
        parts = _pipelined(cfg, topology, core, device, zero_cfg)
    else:
        parts = _parallelized(cfg, topology, core, device, zero_cfg)
    check_materialized(parts.model)  # every strategy allocated what it claimed on the meta model
    return parts


def _pipelined(cfg: JobConfig, topology: Topology, core: nn.Module, device: torch.device,
               zero_cfg: ZeroConfig) -> Assembled:
    """The pipeline keeps this rank's stages and owns their optimizer; its engine (ZeRO / master weights)
    is stepped like any sharded engine."""
    from tessera.train.pipeline_step import PipelineStep

    pipe = PipelineStep.for_job(cfg, topology, core, device, zero_cfg)  # per stage; dp: ddp or ZeRO
    return Assembled(model=pipe.module, core=pipe.module, engine=pipe.engine, pipe=pipe, mode=None,
                     optimizer=pipe.optimizer)


def _parallelized(cfg: JobConfig, topology: Topology, core: nn.Module, device: torch.device,
                  zero_cfg: ZeroConfig) -> Assembled:
    """``parallelize`` and the optimizer: a ZeRO / mixed-precision engine owns the (sharded) optimizer
    over fp32 master weights; otherwise the job's optimizer over ``core``'s parameters."""
    model = parallelize(core, topology, cfg.ddp, zero=zero_cfg, precision=cfg.precision,
                        recompute=cfg.checkpointing,
                        param_groups=lambda m: param_groups(m, cfg.optim),  # after tp
                        make_optimizer=optimizer_factory(cfg.optim, cfg.kernels.adamw),
                        tensor_parallel=cfg.tensor_parallel, context_parallel=cfg.context_parallel,
                        device=device, kernels=cfg.kernels)
    engine = model if is_sharded(model) else None
    optimizer = engine.optimizer if engine else build_optimizer(core, cfg.optim, cfg.kernels.adamw)
    return Assembled(model=model, core=core, engine=engine, pipe=None, mode=None, optimizer=optimizer)
