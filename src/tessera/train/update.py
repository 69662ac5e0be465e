"""The optimizer update of one training step on any layout: unscale, agree on inf/nan, clip, step.

One place decides how a step's gradients become an update, whatever holds them: a data-parallel mode
(local SGD, parameter servers, DataParallel: ``tessera.train.dp_modes``), the pipeline (which may
have stepped inside its schedule), a sharded engine (ZeRO or fp32 master weights), or plain parameters.
With a loss scale, inf/nan gradients on any rank skip the step everywhere and the scaler records it.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.comm.group import CommGroup
from tessera.grad_norm import clip_grad_norm
from tessera.parallelize import norm_axes, sharded_axes
from tessera.precision import LossScaler, unscale_
from tessera.topology import Topology


class StepUpdate:
    """``update()`` → the gradient norm, or None when the step was skipped; ``update.zero_grad()`` after it.

    Built from what the assembly made (``tessera.train.assemble``: at most one of ``mode`` / ``pipe``
    set; ``engine`` a ZeRO / master-weight engine or None), the job's ``scaler``, ``topology``, ``world``
    group, ``device`` and ``optim.grad_clip``. The scaler is read at each call: a resume overwrites its
    fields in place (the same object), so it must not be replaced after this is built."""

    def __init__(self, *, mode, pipe, engine, core: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: LossScaler, topology: Topology, world: CommGroup, device: torch.device,
                 grad_clip: float):
        self.mode, self.pipe, self.engine, self.core, self.optimizer = mode, pipe, engine, core, optimizer
        self.scaler, self.topology, self.world, self.device = scaler, topology, world, device
        self.grad_clip = grad_clip

    def __call__(self) -> float | None:
        if self.mode is not None:
            return self.mode.update(self.grad_clip, self.scaler)
        if self.pipe is not None:
            return self._pipeline()
        if self.engine is not None:
            return self._engine()
        if not self._unscaled():
            return None
        # device given: a rank with no gradient still joins the norm's all-reduces
        grad_norm = clip_grad_norm(self.core.parameters(), norm_axes(self.topology), self.grad_clip,
                                   axes_of=sharded_axes(self.core, self.topology), device=self.device)
        self.optimizer.step()
        return grad_norm

    def zero_grad(self) -> None:
        """Drop the step's gradients, wherever this layout holds them (after the memory snapshot)."""
        if self.mode is not None:
            self.mode.zero_grad()
        elif self.engine is not None:
            self.engine.zero_grad()
        elif self.pipe is not None:
            self.pipe.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _engine(self) -> float | None:
        """Unscale, check for inf/nan on every rank, clip by the global norm over all shards, step.
        Returns the norm, or None when the step was skipped (the loss scale is then halved)."""
        norm, finite = self.engine.clip_grad_norm(self.grad_clip, inv_scale=1.0 / self.scaler.scale)
        if not self.scaler.update(finite):
            return None
        self.engine.step()
        return norm

    def _pipeline(self) -> float | None:
        """PipeDream async updated inside the schedule, after every backward (the step counts as skipped if
        any of those was); otherwise like any other layout, through the engine when one holds the
        optimizer."""
        if self.pipe.steps_inside:
            return self.pipe.clip_grad_norm(0.0) if self._unscaled() else None
        if self.engine is not None:
            return self._engine()
        if not self._unscaled():
            return None
        grad_norm = self.pipe.clip_grad_norm(self.grad_clip)
        self.pipe.step()
        return grad_norm

    def _unscaled(self) -> bool:
        """Without a loss scale: True (nothing to undo). With one: divide the gradients by it (before the
        norm, clipping and the step), agree job-wide whether they are finite and record that in the
        scaler; False means this step is skipped. (A sharded engine does this in ``clip_grad_norm``.)"""
        if not self.scaler.active:
            return True
        inv_scale = 1.0 / self.scaler.scale
        if self.pipe is not None:
            finite = self.pipe.unscale_gradients(inv_scale)
        else:
            grads = [p.grad for p in self.core.parameters() if p.grad is not None]
            finite = unscale_(grads, inv_scale, [self.world], self.device)
        return self.scaler.update(finite)
