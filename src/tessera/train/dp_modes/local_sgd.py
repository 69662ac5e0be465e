"""``ddp.mode = "local-sgd"`` for the trainer: local SGD (``tessera.parameter_server.local_sgd.LocalSGD``) as
a data-parallel mode (the contract: ``tessera.train.dp_modes.base``).

The replicas are the ``dp`` ranks; the cp ranks of one replica (one sequence split over them) still sum their
gradients every step. The trainer's gradients are shares of the global batch (loss ÷ global tokens), so a
replica's own gradient is its share × dp, the gradient of its local batch; averaging after a plain SGD
step then equals one process (every = 1). Clipping and the reported gradient norm are the replica's own
(the norm of rank 0's replica). With mixed precision each replica keeps fp32 masters in a ZeRO-0 engine
over its cp group, and the masters are what is averaged.

Under a pipeline (``tessera.train.dp_modes.assemble``) the mode is built per stage: the replicas are the
stage's dp ranks, each averages this stage's parameters every ``every`` steps, the norm sums over "pp" as well.
"""

from __future__ import annotations

import torch

from tessera import comm
from tessera.comm import CommGroup
from tessera.comm.flat import copy_from_flat
from tessera.grad_norm import clip_grad_norm
from tessera.parameter_server.local_sgd import LocalSGD
from tessera.precision.unscale import unscale_
from tessera.train.dp_modes.base import DataParallelMode, ModeParts


class LocalSGDMode(DataParallelMode):
    """Each dp replica steps its own optimizer on its own batch; parameters averaged every
    ``ddp.average_every`` steps (one all-reduce of the trainable parameters, fp32 masters under mixed precision).
    Not checkpointable: N replicas with N optimizer states are not one single-process state."""

    def __init__(self, parts: ModeParts):
        model, self.device = parts.model, parts.device
        self.dp, self.cp = parts.groups["dp"], parts.groups["cp"]
        self.norm_axes, self.axes_of = parts.norm_axes, parts.axes_of
        groups = parts.param_groups(model)
        engine = None
        if parts.precision.below_fp32:  # fp32 masters; the engine sums gradients over the replica's cp ranks
            from tessera.zero.build import build_engine

            single = CommGroup.single("dp_shard", self.dp.ledger, self.dp.device)
            self.manual = parts.manual  # a pipeline's accumulated gradients: reduced over cp in update
            engine = build_engine(model, groups, parts.make_optimizer, single, self.cp, 0, parts.zero,
                                  parts.precision, parts.device, norm_axes=parts.norm_axes,
                                  param_axes=parts.axes_of, manual=parts.manual)
            engine.update.check_groups = [*engine.update.check_groups, self.dp]  # every replica skips together
            optimizer, averaged = engine.optimizer, [s.master for s in engine.update.shards]
        else:
            optimizer = parts.make_optimizer(groups)
            averaged = [p for g in groups for p in g["params"]]
        super().__init__(engine if engine is not None else model, optimizer, engine)
        self.local = LocalSGD(averaged, self.dp, parts.ddp.average_every)

    def update(self, max_norm: float, scaler) -> float | None:
        inv_scale = self.dp.size / scaler.scale if scaler.active else float(self.dp.size)
        if self.engine is not None:
            if self.manual:
                self.engine.reduce_gradients()
            norm, finite = self.engine.clip_grad_norm(max_norm, inv_scale=inv_scale)
        else:
            norm, finite = self._clip(max_norm, inv_scale)
        if scaler.update(finite):
            self.engine.step() if self.engine is not None else self.optimizer.step()
        else:
            norm = None
        if self.local.after_step() and self.engine is not None:  # averaged the masters: to the parameters
            self.engine.update.refresh_params()
        return norm

    @torch.no_grad()
    def _clip(self, max_norm: float, inv_scale: float) -> tuple[float, bool]:
        """fp32: sum over the replica's cp ranks, make it the local batch's gradient, agree on finiteness
        everywhere, clip by the replica's norm. (norm, finite)."""
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads and self.cp.size > 1:  # one all-reduce of the flat gradient [G], each element the same sum
            flat_G = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat_G, self.cp)
            copy_from_flat(grads, flat_G)
        if not unscale_(grads, inv_scale, [self.cp, *self.norm_axes.values(), self.dp], self.device):
            return float("inf"), False
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return clip_grad_norm(params, self.norm_axes, max_norm, axes_of=self.axes_of, device=self.device), True
