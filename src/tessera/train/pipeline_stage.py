"""What happens to one pipeline stage module before it runs: the model-side strategies of the layout
(tensor parallelism, ...) applied to the part of the model this stage holds.

The data-parallel side (gradient reduction over "dp", ZeRO, mixed-precision master weights) is applied by
``tessera.train.pipeline_step`` to all of this rank's stages at once, in manual mode.

Interface used by ``PipelineStep``::

    prepare = stage_preparer(topology, settings, loss_weight)   # None: stages run as built
    split = sequence_split(topology, settings)                   # activation_BsD between stages: s = S/split

``settings`` carries the job's config sections (``tensor_parallel``, ...); ``loss_weight()`` returns the
factor (loss scale / global token count) that a stage's own loss terms are multiplied by before backward.
"""

from __future__ import annotations

import fnmatch
from typing import Callable

import torch
from torch import nn

from tessera.comm.group import CommGroup


def stage_preparer(topology, settings, loss_weight: Callable[[], float] | None = None):
    """``prepare(stage) -> stage`` for ``build_pipeline``, or None when the layout changes nothing."""
    tp = topology.group("tp")
    if tp.size == 1:
        return None
    tensor_parallel = getattr(settings, "tensor_parallel", None)
    return lambda stage: _tensor_parallel_stage(stage, tp, tensor_parallel)


def sequence_split(topology, settings) -> int:
    """How many pieces the sequence of an activation between stages is cut into (sequence parallelism)."""
    cfg = getattr(settings, "tensor_parallel", None)
    tp = topology.size("tp")
    return tp if (cfg is not None and cfg.sequence_parallel and tp > 1) else 1


def _tensor_parallel_stage(stage: nn.Module, tp: CommGroup, cfg) -> nn.Module:
    """Megatron 1D tensor parallelism on one stage module, with the default plan's entries for the
    parts this stage holds (no embedding on later stages, no norm / head on earlier ones)."""
    from tessera.tensor_parallel import apply_tensor_parallel, default_plan

    names = [name for name, _ in stage.named_modules() if name]
    plan = {k: v for k, v in default_plan().items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
    stage = apply_tensor_parallel(stage, tp, cfg, plan)
    if cfg is not None and cfg.sequence_parallel and stage.tok_embeddings is None:
        # a later stage receives activation_BsD (s = S/N): its rotary tables must span all S positions
        stage.register_forward_pre_hook(
            lambda mod, args: (args[0], torch.arange(args[0].shape[1] * tp.size, device=args[0].device)))
    return stage
