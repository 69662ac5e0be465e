"""``ddp.mode = "dataparallel"`` / ``"central-storage"`` for the trainer: single-process, multi-device data
parallelism (``tessera.parameter_server.legacy_dp.DataParallel``) as a data-parallel mode (the contract:
``tessera.train.dp_modes.base``).

World size 1: the model wrapped in DataParallel over ``ddp.devices`` (empty: every visible accelerator of
``run.device``'s kind; on a CPU the validation asks for the list), one optimizer over the variables
(fp32 masters in a ZeRO-0 engine of one rank under mixed precision). The sum over devices happens in
backward, so the step is a plain one-process step.
"""

from __future__ import annotations

import torch

from tessera.comm import CommGroup
from tessera.device import visible_devices
from tessera.grad_norm import clip_grad_norm
from tessera.parameter_server.legacy_dp import DataParallel
from tessera.precision.unscale import unscale_
from tessera.train.dp_modes.base import DataParallelMode, ModeParts


class SingleProcessMode(DataParallelMode):
    def __init__(self, parts: ModeParts):
        model, ddp = parts.model, parts.ddp
        self.device = torch.device("cpu") if ddp.mode == "central-storage" else parts.device
        groups, engine = parts.param_groups(model.to(self.device)), None
        if parts.precision.below_fp32:  # the engine's forward is the model's; DataParallel replicates it
            from tessera.zero.build import build_engine

            single = CommGroup.single("dp", parts.dp.ledger, parts.dp.device)
            engine = build_engine(model, groups, parts.make_optimizer, single, single, 0, parts.zero,
                                  parts.precision, self.device, norm_axes=parts.norm_axes,
                                  param_axes=parts.axes_of)
        # ddp.devices left empty: every visible device of run.device's kind (validation asks a CPU for a list)
        wrapper = DataParallel(engine if engine is not None else model, ddp.devices or visible_devices(parts.device),
                               variable_device=self.device)
        super().__init__(wrapper, engine.optimizer if engine is not None else parts.make_optimizer(groups), engine)

    def update(self, max_norm: float, scaler) -> float | None:
        if self.engine is not None:
            norm, finite = self.engine.clip_grad_norm(max_norm, inv_scale=1.0 / scaler.scale)
            if not scaler.update(finite):
                return None
            self.engine.step()
            return norm
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        if scaler.active and not scaler.update(unscale_(grads, 1.0 / scaler.scale, [], self.device)):
            return None
        norm = clip_grad_norm(params, {}, max_norm, device=self.device)
        self.optimizer.step()
        return norm
