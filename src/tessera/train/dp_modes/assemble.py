"""The trainer's side of ``ddp.mode`` other than "allreduce": the model-side strategies, then the mode.

``parallelize`` would wrap the model in DDP or a ZeRO engine; a data-parallel mode
(``tessera.train.dp_modes``) replaces that last link of the chain: tp → cp → kernels → recompute run
as always (``parallelize_model_side``), the model is materialised, and the mode decides how replicas
combine at the step.

Under a pipeline (``parallel.pp`` > 1) the mode is built per stage: the pipeline step keeps this rank's
stages (model-side strategies included) and reduces nothing over data parallelism (``mode_exchanges``);
the mode is built over those stages (``pipe.module``) and the stage's replicas (``pipe.dp``: the ranks
with the same pp and tp coordinates), with the pipeline's gradient-norm rule (squares summed over "pp",
the tied embedding counted once). The schedule accumulates every micro-batch's gradient (the tied copies
summed) before the mode's ``update``, so an engine the mode holds reduces manually, once per step.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.models.init import materialize
from tessera.parallelize import data_parallel_group, norm_axes, parallelize_model_side, sharded_axes
from tessera.topology import Topology
from tessera.train.dp_modes.base import DataParallelMode, ModeParts
from tessera.train.dp_modes.registry import build_mode
from tessera.train.optim import optimizer_factory, param_groups


def assemble_mode(cfg, topology: Topology, core: nn.Module, device: torch.device) -> DataParallelMode:
    """The mode of ``cfg.ddp.mode`` around ``core`` (the meta model), materialised on ``device``."""
    parallelize_model_side(core, topology, tensor_parallel=cfg.tensor_parallel,
                           context_parallel=cfg.context_parallel, recompute=cfg.checkpointing, kernels=cfg.kernels)
    materialize(core, device)
    return build_mode(_parts(cfg, topology, core, data_parallel_group(topology), norm_axes(topology),
                             sharded_axes(core, topology), device, manual=False))


def assemble_pipelined_mode(cfg, topology: Topology, core: nn.Module, device: torch.device, zero_cfg):
    """(pipeline step, mode): this rank's stages of ``core`` and the mode of ``cfg.ddp.mode`` over them."""
    from tessera.train.pipeline_step import PipelineStep

    pipe = PipelineStep.for_job(cfg, topology, core, device, zero_cfg, mode_exchanges=True)
    mode = build_mode(_parts(cfg, topology, pipe.module, pipe.dp, norm_axes(topology, pipeline=True),
                             pipe._axes_of, device, manual=True))
    return pipe, mode


def _parts(cfg, topology: Topology, model: nn.Module, dp, axes: dict, axes_of, device: torch.device,
           manual: bool) -> ModeParts:
    groups = {name: topology.group(name) for name in ("dp", "cp", "tp", "world")}
    return ModeParts(model=model, dp=dp, groups=groups, ddp=cfg.ddp, precision=cfg.precision, zero=cfg.zero,
                     param_groups=lambda m: param_groups(m, cfg.optim),
                     make_optimizer=optimizer_factory(cfg.optim, cfg.kernels.adamw), norm_axes=axes,
                     axes_of=axes_of, device=device, manual=manual)
