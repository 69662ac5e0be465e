"""What happens to one pipeline stage module before it runs: the model-side strategies of the layout
(tensor parallelism (+SP), context parallelism, activation checkpointing, expert parallelism) applied to
the part of the model this stage holds, by the same function and in the same order as for a whole model
(``tessera.parallelize.parallelize_model_side``), plus what only a stage needs:

- positions: a later stage receives activation_BsD, not tokens, so under SP (s = L/tp) it is told the
  absolute positions of its L tokens (the zig-zag ones of its cp rank under cp too, L = S/cp);
- routing losses: a mixture-of-experts stage's auxiliary losses (``moe_loss_sum``, sums over its tokens)
  reach the job's gradient as in one process, where they are added to the micro-batch's summed token loss
  before the division by the global token count: the stage output passes an identity whose backward
  also sends ``loss_weight()`` (loss scale / global tokens) into the routing losses' graph (Megatron's
  MoEAuxLossAutoScaler idea), so no stage needs the loss or another stage's terms. A pipeline
  micro-batch (the rank's batch / ``pipeline.microbatches``) is one routing group (capacity, losses): a
  run equals one process whose ``data.micro_batch_size`` is that many sequences.

The data-parallel side (gradient reduction over dp × cp, ZeRO, mixed-precision master weights) is applied
by ``tessera.train.pipeline_step`` to all of this rank's stages at once, in manual mode. A stage cut from a
model on the meta device is materialised here, after its model-side strategies (ZeRO-3 excepted: its
engine fills its shards from the meta stage).

Interface used by ``PipelineStep``::

    prepare = stage_preparer(topology, settings, loss_weight, device)   # prepare(stage) -> stage
    split = sequence_split(topology, settings)                   # activation_BsD between stages: s = S/split

``settings`` carries the job's config sections (``tensor_parallel``, ``context_parallel``, ``checkpointing``,
``moe``, ...), read with defaults; ``loss_weight()`` returns the factor (loss scale / global token count of
the current step) that a stage's own loss terms are multiplied by before backward.

Legend: B batch, S sequence, L = S/cp tokens of a cp rank, s = L/tp under SP else L, D model dim.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tessera.context_parallel import zigzag_positions
from tessera.models.moe import MoELayers, moe_loss_sum
from tessera.parallelize import materialize_unless_sharded, parallelize_model_side


def stage_preparer(topology, settings, loss_weight: Callable[[], float] | None = None,
                   device: torch.device | None = None):
    """``prepare(stage) -> stage`` for ``build_pipeline`` (in place; a plain layout changes nothing).
    Without ``loss_weight`` a stage's routing losses get weight 1 (a caller whose loss is not divided).
    A stage cut from a meta-device model is materialised on ``device`` (default: the topology's) once
    the model-side strategies have claimed their parts, unless ZeRO-3 fills it (see
    ``tessera.parallelize.materialize_unless_sharded``)."""
    weight = loss_weight or (lambda: 1.0)
    device = device if device is not None else topology.device

    def prepare(stage: nn.Module) -> nn.Module:
        parallelize_model_side(stage, topology, tensor_parallel=getattr(settings, "tensor_parallel", None),
                               context_parallel=getattr(settings, "context_parallel", None),
                               recompute=getattr(settings, "checkpointing", None),
                               kernels=getattr(settings, "kernels", None))
        materialize_unless_sharded(stage, topology, device)
        split = sequence_split(topology, settings)
        if split > 1 and stage.tok_embeddings is None:
            # first, so that context parallelism's own hook finds the positions given
            stage.register_forward_pre_hook(_positions_hook(topology, split), with_kwargs=True, prepend=True)
        moe = MoELayers(stage)  # after the strategies: expert parallelism replaces the layers
        if moe:
            stage.register_forward_hook(_routing_loss_hook(weight, moe))
        return stage

    return prepare


def sequence_split(topology, settings) -> int:
    """How many pieces a cp rank's sequence of an activation between stages is cut into (sequence
    parallelism; the trainer's micro-batches hold a cp rank's L tokens already)."""
    cfg = getattr(settings, "tensor_parallel", None)
    tp = topology.size("tp")
    return tp if (cfg is not None and cfg.sequence_parallel and tp > 1) else 1


def _positions_hook(topology, split: int):
    """Forward pre-hook of a later stage under SP: its input activation_BsD holds 1/``split`` of the
    rank's L tokens, whose absolute positions are 0..L-1, or the cp rank's zig-zag positions of S."""
    cp = topology.group("cp")

    def hook(module, args, kwargs):
        if kwargs.get("positions") is not None:
            return None
        local = args[0].shape[1] * split  # L
        device = args[0].device
        positions = (zigzag_positions(local * cp.size, cp.rank, cp.size, device=device) if cp.size > 1
                     else torch.arange(local, device=device))
        return args, {**kwargs, "positions": positions}

    return hook


def _routing_loss_hook(loss_weight: Callable[[], float], moe: MoELayers):
    """Forward hook of a mixture-of-experts stage: collect the routing losses of this forward (a 0-d
    sum over the stage's MoE layers ``moe``) and tie them to the stage output (see :class:`_AddRoutingLoss`)."""

    def hook(module, args, out):
        aux = moe_loss_sum(moe)
        if isinstance(aux, torch.Tensor) and aux.requires_grad and torch.is_grad_enabled():
            return _AddRoutingLoss.apply(out, aux, loss_weight())
        return None

    return hook


class _AddRoutingLoss(torch.autograd.Function):
    """Forward: the stage output unchanged. Backward: the output's gradient unchanged, and ``weight`` as
    the gradient of the routing-loss sum ``aux`` (0-d): d(job loss)/d(aux) = loss scale / global tokens,
    the factor the micro-batch's token loss sum is multiplied by. Nothing is saved: the executor may
    free the output's data once it is sent, and a checkpoint's recomputation saves what its forward did."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_dtype, ctx.aux_device = weight, aux.dtype, aux.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=ctx.aux_device), None
