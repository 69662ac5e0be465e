"""The interface of a data-parallel mode other than DDP (``ddp.mode``): what the trainer calls.

``ddp.mode = "allreduce"`` is DDP (``tessera.parallelize``). Every other mode is a :class:`DataParallelMode`
the trainer builds instead of the data-parallel wrapper (``tessera.train.dp_modes.assemble``, after the
model-side strategies tp → cp → kernels → recompute were applied and the model materialised). Backward
communicates nothing in these modes; the exchange happens in :meth:`DataParallelMode.update`. A mode
combines several strategies (parameter servers, ZeRO engines, the gradient norm, loss scaling), which is
why it lives in the training layer; the registry of modes is ``tessera.train.dp_modes.registry``.

The contract (what the trainer calls, and nothing else):

- ``mode.model``: the module forward / backward / evaluation run (the model, or a wrapper of it);
- ``mode.optimizer``: the optimizer the learning-rate schedule drives, on EVERY rank (a rank that holds
  no optimizer state, e.g. a worker of a rank-0 server, holds one over placeholder tensors: same groups,
  same lr, never stepped);
- ``mode.engine``: a ZeRO / master-weight engine the checkpoint reads (``tessera.train.checkpoint``), or
  None when ``model``'s parameters and ``optimizer``'s state are the training state;
- ``mode.update(max_norm, scaler) -> float | None``: after the backward of a step: undo the loss scale,
  agree job-wide whether the gradients are finite (``scaler.update(finite)`` on every rank, in the same
  order), clip by the global norm ``max_norm`` (0: no clipping), exchange and step; returns the norm
  (what the metrics report) or None when the step was skipped;
- ``mode.zero_grad()``: after the step (and its memory snapshot): drop every gradient it holds;
- ``mode.before_eval()``: make the parameters evaluation reads current (a stale worker pulls from its
  server); collective when it communicates;
- ``mode.close()``: stop threads / servers; no collective may be left pending;
- ``mode.step_group``: the group a step's tokens and loss are summed over, or None (the default) for the
  trainer's dp × cp (an asynchronous worker's is itself); ``mode.stats() -> dict``: fields added to every
  metrics line and the summary (default: none);
- a builder's ``checkpointable`` attribute (default True): False when the mode's state cannot be a
  layout-independent checkpoint by construction; ``validate_modes`` then refuses ``checkpoint.every`` and
  ``checkpoint.resume``, with the builder's ``checkpoint_refusal`` sentence part when it has one.

The gradients ``update`` finds are the trainer's convention (``tessera.train.step``): every rank's loss
is divided by the tokens of the GLOBAL batch, so the sum over the data-parallel group is the one-process
gradient, and one rank's gradient is its share (1/N of a local mean on equal shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tessera.comm.group import CommGroup


@dataclass
class ModeParts:
    """What a mode is built from (``tessera.train.dp_modes.assemble`` fills it)."""

    model: nn.Module  # materialised; tp / cp / recompute / kernels already applied
    dp: CommGroup  # the replicas: ranks holding the same parameters, seeing different tokens (dp × cp;
    # under a pipeline, the replicas of this rank's stages)
    groups: dict  # name -> CommGroup of the topology: "dp", "cp", "tp", "world" (size 1 where absent)
    ddp: object  # the DDPConfig: mode, consistency, staleness, average_every, devices
    precision: object  # the PrecisionConfig
    zero: object  # the ZeroConfig (bucket sizes of a sharded engine)
    param_groups: Callable[[nn.Module], list[dict]]  # model -> optimizer param groups (weight decay split)
    make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]  # groups -> the job's optimizer
    norm_axes: dict  # axes some gradients are split on (tp): tessera.grad_norm's ``axes``
    axes_of: Callable  # parameter -> frozenset of those axes it is split on
    device: torch.device
    # True under a pipeline: the schedule's many backwards accumulate the gradients, which an engine the
    # mode holds then reduces once in ``update`` (no backward hooks)
    manual: bool = False


class DataParallelMode:
    """Base of every mode: the defaults of the contract above (module docstring)."""

    step_group: CommGroup | None = None  # None: a step's tokens are summed over the trainer's dp × cp

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, engine=None):
        self.model, self.optimizer, self.engine = model, optimizer, engine

    def update(self, max_norm: float, scaler) -> float | None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        if self.engine is not None:
            self.engine.zero_grad()
        for p in self.model.parameters():
            p.grad = None

    def before_eval(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def placeholder_optimizer(make_optimizer, groups: list[dict], device) -> torch.optim.Optimizer:
    """The job's optimizer over one empty tensor per param group: the lr schedule drives it like the real
    one, it holds no state and no parameter, and a checkpoint finds nothing of it to save."""
    stand_ins = [{**g, "params": [torch.zeros(0, device=device, requires_grad=True)]} for g in groups]
    return make_optimizer(stand_ins)
