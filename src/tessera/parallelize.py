"""The one place that knows the order in which strategies are applied to a model.

Order (torchtitan's, extended): pipeline split → tensor parallel (+ sequence parallel) → context
parallel → [kernels] (compile of the blocks' forwards, when asked) → activation checkpointing → expert
parallel → mixed precision → data parallel / ZeRO.
The model-side part of that chain (tp → cp → kernels → checkpointing → ep) is :func:`parallelize_model_side`, which
:func:`parallelize` applies to a whole model and the pipeline (``tessera.train.pipeline_stage``) to each of
its stages; the pipeline step itself and its data-parallel side are ``tessera.train.pipeline_step``'s,
which calls :func:`norm_axes` / :func:`sharded_axes` too, so every clipping path counts each gradient
element once by the rule of ``tessera.grad_norm``. The supported hybrids and the pairings rejected by
``tessera.composition.validate_composition`` (before any rank starts, with a sentence saying why) are
listed in docs/HYBRID.md.

Materialisation: ``model`` may be described on the meta device (``Transformer(cfg, seed=s)`` built under
``torch.device("meta")``): the model-side strategies claim their parts on it (tp slices, experts; a
pipeline its stages), and only then each rank allocates what it holds (``tessera.models.init``):
:func:`materialize_unless_sharded` fills the parameters on ``device``, except for ZeRO-3, whose engine
receives the meta model and fills only its own flat shards from the origins. A real model passes through
unchanged.

Gradient convention: data-parallel gradients are *summed* over ranks, so the training loss on each
rank must already be divided by the global number of tokens in the step (the trainer does this); that
keeps the result identical to one process however tokens are spread over ranks and micro-batches.
"""

from __future__ import annotations

import fnmatch
from dataclasses import replace

import torch
from torch import nn

from tessera.data_parallel import DDPConfig, DistributedDataParallel
from tessera.kernels.apply import apply_kernels
from tessera.kernels.compile import apply_compile
from tessera.models.init import materialize, materialize_buffers
from tessera.precision import PrecisionConfig
from tessera.recompute import RecomputeConfig, apply_checkpointing
from tessera.topology import Topology
from tessera.zero import FullyShardedDataParallel, ZeroConfig, ZeroDataParallel
from tessera.zero.build import shard_model


def data_parallel_group(topology: Topology):
    """The ranks that hold the same parameters and see different tokens: dp, times cp when cp > 1."""
    return topology.group("dp_cp")


def parallelize(model: nn.Module, topology: Topology, ddp: DDPConfig, *, zero: ZeroConfig | None = None,
                precision: PrecisionConfig | None = None, recompute: RecomputeConfig | None = None,
                param_groups: list[dict] | None = None, make_optimizer=None, tensor_parallel=None,
                context_parallel=None, device: torch.device = torch.device("cpu"), kernels=None) -> nn.Module:
    """Apply every strategy the topology asks for to ``model`` (in place where possible).

    Tensor parallelism (+SP; MoE feed-forwards stay whole on every tp rank), then context parallelism,
    then activation checkpointing, then expert parallelism (with DDP or ZeRO-1/2 over dp / edp), or mixed precision
    and ZeRO (``parallel.zero_stage`` ≥ 1, or low precision, which needs fp32 master weights), or else
    DDP over dp × cp. A sharded engine owns the optimizer, built by ``make_optimizer(groups)`` over master
    shards of ``param_groups`` (see :func:`is_sharded`), and clips by the job-wide norm. ``param_groups``
    may be a callable ``model -> groups``, called after tensor parallelism replaced the layers.
    """
    parallelize_model_side(model, topology, tensor_parallel=tensor_parallel, context_parallel=context_parallel,
                           recompute=recompute, kernels=kernels)
    materialize_unless_sharded(model, topology, device)
    if topology.size("ep") > 1:  # experts sharded over ep; dense grads over dp, expert grads over edp
        from tessera.moe import expert_parallelize, expert_zero

        if engine_holds_optimizer(topology.config, precision):  # ZeRO 0-3: dense state over dp, experts over edp
            model = expert_zero(model, topology, param_groups, make_optimizer, topology.config.zero_stage,
                                zero or ZeroConfig(), norm_axes(topology), sharded_axes(model, topology),
                                precision=precision, device=device)
        else:
            model = expert_parallelize(model, topology, ddp)
        return model
    precision = precision or PrecisionConfig()
    stage = topology.config.zero_stage
    if engine_holds_optimizer(topology.config, precision):
        from tessera.models.layers import TransformerBlock

        if callable(param_groups):  # built from the model as it is now (tp replaced its linear layers)
            param_groups = param_groups(model)
        return shard_model(model, param_groups, make_optimizer, topology, stage, zero or ZeroConfig(),
                           precision, device, block_class=TransformerBlock, norm_axes=norm_axes(topology),
                           param_axes=sharded_axes(model, topology))
    dp = data_parallel_group(topology)
    if dp.size > 1:
        model = DistributedDataParallel(
            model, dp, bucket_mb=ddp.bucket_mb, find_unused_parameters=ddp.find_unused_parameters,
            reduce_op="sum",
        )
    return model


def parallelize_model_side(model: nn.Module, topology: Topology, *, tensor_parallel=None, context_parallel=None,
                           recompute: RecomputeConfig | None = None, kernels=None) -> nn.Module:
    """The model-side strategies, in place and in the one order: tensor parallelism (+SP; MoE
    feed-forwards left whole), context-parallel attention cores, ``torch.compile`` of each block's forward
    when ``kernels.compile`` (below every module hook; ``tessera.kernels.compile``), activation
    checkpointing of the blocks (around the compiled forward), expert-parallel MoE layers (all-to-all
    over "ep"; under SP run on the whole sequence). ``model`` is a whole Transformer or one pipeline
    stage of it (its ``layers`` keep the model's keys, so ``checkpointing.every`` picks the same blocks
    in both). :func:`parallelize` and the pipeline's stage
    preparation (``tessera.train.pipeline_stage``) both call it; the data-parallel side is theirs."""
    tp_cfg = None
    if topology.size("tp") > 1:
        tp_cfg = apply_tp(model, topology.group("tp"), tensor_parallel, topology.partitions["tp"])
    if topology.size("cp") > 1:
        from tessera.context_parallel import ContextParallelConfig, apply_context_parallel

        apply_context_parallel(model, topology.group("cp"), context_parallel or ContextParallelConfig())
    apply_kernels(model, kernels)  # rms_norm / gqa on the norms and cores tp and cp left, before tracing
    apply_compile(model, kernels)  # lazy: traced at first call, after ep and dp wrap
    if recompute is not None and recompute.mode != "none":
        every = recompute.every  # by the model's block index, which a stage's layer keys keep
        blocks = [block for key, block in model.layers.items() if int(key) % every == 0]
        apply_checkpointing(blocks, replace(recompute, every=1))
    if topology.size("ep") > 1:
        from tessera.moe import apply_expert_parallel

        apply_expert_parallel(model, topology.group("ep"))
    if tp_cfg is not None and tp_cfg.sequence_parallel:
        whole_moe_under_sp(model, topology.group("tp"))  # after ep replaced the layers: hooks on those that run
    return model


def materialize_unless_sharded(model: nn.Module, topology: Topology, device: torch.device) -> nn.Module:
    """Allocate and fill on ``device`` the meta parameters of ``model``, after every model-side strategy
    claimed its part, unless the data-parallel engine is ZeRO-3 (dense or expert), which fills its flat
    shards from the meta parameters' origins itself; meta buffers (RoPE tables, …) are made here either
    way (a pipeline's ZeRO-3 engine sees the stages' parameters, not the stage modules). Real tensors are
    left as they are."""
    if topology.config.zero_stage != 3:
        materialize(model, device)
    else:
        materialize_buffers(model, device)
    return model


def engine_holds_optimizer(parallel, precision: PrecisionConfig | None = None) -> bool:
    """Whether a ZeRO / fp32-master-weight engine (:func:`is_sharded`) holds the optimizer of a job with
    layout ``parallel`` (a resolved ParallelConfig): ZeRO at any stage, or low-precision parameters or
    gradients reduced in a dtype other than the parameters' (master weights in fp32), under every layout
    (a pipeline's stages and expert parallelism included). The one rule :func:`parallelize` and
    ``tessera.train.pipeline_step`` follow and ``tessera.train.settings`` judges ``[zero]`` / ``[ddp]`` keys by."""
    return parallel.zero_stage > 0 or (precision or PrecisionConfig()).below_fp32


def apply_tp(model: nn.Module, tp, cfg=None, partition=None):
    """Megatron 1D tensor parallelism over ``tp`` with the default plan's entries for the parts ``model``
    holds (a whole Transformer, or a pipeline stage: no embedding on later stages, no norm / head on
    earlier ones); mixture-of-experts feed-forwards are left whole (replicated over tp, see
    ``tensor_parallel/replicated.py``). ``cfg.mode`` "2d" / "2.5d" / "3d": the whole model on Colossal-AI's
    grids (``tensor_parallel/nd/model.py``), which need ``partition``, every tp group of the job (the
    topology's ``partitions["tp"]``). Returns the TensorParallelConfig."""
    from tessera.models.moe import MoEFeedForward
    from tessera.tensor_parallel import TensorParallelConfig, apply_tensor_parallel, default_plan
    from tessera.tensor_parallel.replicated import plan_without

    cfg = cfg or TensorParallelConfig()
    if cfg.mode != "1d":
        from tessera.tensor_parallel.nd.model import apply_nd_tensor_parallel

        apply_nd_tensor_parallel(model, tp, cfg, partition)
        return cfg
    moe = {name for name, m in model.named_modules() if isinstance(m, MoEFeedForward)}
    plan = plan_without(default_plan(), model, moe) if moe else default_plan()
    names = [name for name, _ in model.named_modules() if name]
    plan = {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
    apply_tensor_parallel(model, tp, cfg, plan)
    return cfg


def whole_moe_under_sp(model: nn.Module, tp) -> None:
    """Under sequence parallelism, run every MoE feed-forward on the whole sequence (after expert
    parallelism replaced the layers, so the hooks sit on the modules that run)."""
    from tessera.models.moe import moe_layers
    from tessera.tensor_parallel.replicated import whole_sequence_hooks

    for layer in moe_layers(model):
        whole_sequence_hooks(layer, tp)


def norm_axes(topology: Topology, pipeline: bool = False) -> dict:
    """The axes along which some parameter's gradient is split (the job-wide norm sums over them):
    tp, ep, and pp for a pipeline; a ZeRO engine adds its shard group. The ``axes`` argument of
    ``tessera.grad_norm.clip_grad_norm``, which every clipping path calls."""
    axes = {a: topology.group(a) for a in ("tp", "ep") if topology.size(a) > 1}
    if pipeline and topology.size("pp") > 1:
        axes["pp"] = topology.group("pp")
    return axes


def sharded_axes(model: nn.Module, topology: Topology):
    """``axes_of(parameter) -> frozenset``: "tp" for tensor-parallel splits, "ep" for experts (every
    other parameter is replicated along those axes); the ``axes_of`` of ``tessera.grad_norm.clip_grad_norm``."""
    from tessera.tensor_parallel.linear import is_sharded as tp_sharded

    experts = set()
    if topology.size("ep") > 1:
        from tessera.moe import expert_parameters

        experts = {id(p) for p in expert_parameters(model)}

    def axes_of(p) -> frozenset:
        return frozenset(("tp",) if tp_sharded(p) else ()) | frozenset(("ep",) if id(p) in experts else ())

    return axes_of


def unwrap(model: nn.Module) -> nn.Module:
    """The single-device model inside any wrapper ``parallelize`` added."""
    from tessera.moe import ExpertDataParallel, ExpertZeroDataParallel

    while isinstance(model, (DistributedDataParallel, ZeroDataParallel, FullyShardedDataParallel,
                             ExpertDataParallel, ExpertZeroDataParallel)):
        model = model.module
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a ZeRO / master-weight engine: it owns the optimizer and is stepped through
    ``clip_grad_norm(max_norm, inv_scale) -> (norm, finite)``, ``step()`` and ``zero_grad()``."""
    from tessera.moe import ExpertZeroDataParallel

    return isinstance(model, (ZeroDataParallel, FullyShardedDataParallel, ExpertZeroDataParallel))
