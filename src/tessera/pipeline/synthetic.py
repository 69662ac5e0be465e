"""A stage with fixed action times, to measure what a schedule itself costs (its bubble).

``TimedStage(dim, forward_s, backward_s, weight_s)`` computes y_BD = x_BD * (1 + w_D) and sleeps
``forward_s`` in the forward, ``backward_s`` for the input gradient and ``weight_s`` for the weight
gradient (deferred to the W action when a zero-bubble schedule splits the backward). Sleeping, not
spinning, so several ranks sharing few cores still see exactly the stage times they were given.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from tessera.pipeline.split_backward import WeightGradStore


class _Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, stage):
        time.sleep(stage.forward_s)
        ctx.save_for_backward(x, w)
        ctx.stage = stage
        return x * (1 + w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        stage = ctx.stage
        time.sleep(stage.backward_s)
        g_x = g * (1 + w)

        def weight_grad():
            time.sleep(stage.weight_s)
            return (g * x).sum(0)

        store = stage.weight_grad_store
        if store is not None and store.deferring:
            def later():
                gw = weight_grad()
                stage.w.grad = gw if stage.w.grad is None else stage.w.grad + gw
            store.push(later)
            return g_x, None, None
        return g_x, weight_grad(), None


class TimedStage(nn.Module):
    def __init__(self, dim: int, forward_s: float, backward_s: float, weight_s: float):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(dim))
        self.forward_s, self.backward_s, self.weight_s = forward_s, backward_s, weight_s
        self.weight_grad_store: WeightGradStore | None = None  # set by the executor for split schedules

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        return _Timed.apply(x_BD, self.w, self)
