"""``zero.wrap_paths`` / ``zero.wrap_classes`` checked against the model as the job will run it.

ZeRO-3 chooses its units on the model after the model-side strategies replaced layers: LoRA's adapted
linears (``LoRALinear``), tensor parallelism's ``ColumnParallelLinear`` / ``RowParallelLinear`` / vocab-parallel
embedding and head, expert parallelism's MoE layers. So the entries are matched (by
:func:`tessera.zero.wrap.selects`, the rule the run-time policy uses) against that model, described on the
meta device before any rank starts: the same transforms ``tessera.train.model_build.meta_model`` and
``tessera.parallelize.parallelize_model_side`` apply, with stand-in groups of the job's tp / ep sizes that
never communicate (building those layers on meta only records which slice each holds). Every replacement
sits at the path of the layer it replaces, so a path means the same module with and without LoRA and tp
(LoRA adds ``<layer>.lora_A`` / ``lora_B``, which are never called and refused as units). Context
parallelism, recomputation and kernels change no module holding parameters, and a pipeline's stages keep
the model's paths, so none of them is applied here.

The grid modes of tensor parallelism (``tensor_parallel.mode`` 2d / 2.5d / 3d) build their layers from the
job's process groups, which do not exist before launch; their layers keep the model's paths, so
``zero.wrap_paths`` is checked on the model without tp, and ``zero.wrap_classes`` is refused there.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tessera.comm.group import CommGroup
from tessera.errors import ConfigError
from tessera.zero.wrap import check_wrap_targets


def stand_in(axis: str, size: int) -> CommGroup:
    """A group of ``size`` ranks seen from rank 0 with no process group: enough to build a strategy's layers
    on the meta device (they read only its size and rank); any collective on it would fail."""
    return CommGroup(axis, None, tuple(range(size)), 0, device="meta")


def running_model(cfg, parallel) -> nn.Module:
    """The job's model (``cfg`` a JobConfig, ``parallel`` its resolved layout) on the meta device with the
    layers LoRA, 1D tensor parallelism and expert parallelism put in place, as every rank's units see them."""
    from tessera.lora.layer import add_lora
    from tessera.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe, seed=cfg.run.seed)
    add_lora(model, replace(cfg.lora, init_from=""), cfg.run.seed)  # the values do not matter, the layers do
    if parallel.tp > 1 and cfg.tensor_parallel.mode == "1d":
        from tessera.parallelize import apply_tp

        apply_tp(model, stand_in("tp", parallel.tp), cfg.tensor_parallel)
    if parallel.ep > 1:
        from tessera.moe import apply_expert_parallel

        apply_expert_parallel(model, stand_in("ep", parallel.ep))
    return model


def check_wrap_config(cfg, parallel) -> None:
    """With ``zero.wrap_paths`` / ``zero.wrap_classes`` set, refuse (one sentence) an entry that selects no
    module of the model as this job runs it, or one ZeRO-3 could not gather (``tessera.zero.wrap``)."""
    zero = cfg.zero
    if not (zero.wrap_paths or zero.wrap_classes):
        return
    if zero.wrap_classes and parallel.tp > 1 and cfg.tensor_parallel.mode != "1d":
        raise ConfigError(f"zero.wrap_classes cannot be checked under tensor_parallel.mode="
                          f"{cfg.tensor_parallel.mode!r}: its grid layers are built from the job's process groups, "
                          f"which do not exist before launch; name the units by zero.wrap_paths (the grid layers "
                          f"keep the model's paths)")
    check_wrap_targets(running_model(cfg, parallel), list(zero.wrap_paths), list(zero.wrap_classes))
