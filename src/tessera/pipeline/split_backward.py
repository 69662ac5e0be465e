"""Zero-bubble backward split: input gradients now (B), weight gradients later (W).

Every ``nn.Linear`` of a stage is routed through :class:`_SplitLinear`. While a :class:`WeightGradStore`
is *deferring* (inside ``store.defer(mb)``), a linear's backward returns only dX_BSI = dY_BSO @ W_OI and
queues the closure that computes dW_OI = dY^T X (and db) for micro-batch ``mb``; ``store.flush(mb)`` runs
those closures and accumulates into ``.grad`` (the W action). Outside ``defer`` the backward is the
ordinary one. Small parameters (norms, embeddings) get their gradients in B, as in Qi et al. 2023.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.lora.layer import has_adapter, lora_delta


class WeightGradStore:
    """Queued weight-gradient closures per micro-batch."""

    def __init__(self):
        self._queues: dict[int, list[Callable[[], None]]] = defaultdict(list)
        self._current: int | None = None

    @contextlib.contextmanager
    def defer(self, mb: int):
        prev, self._current = self._current, mb
        try:
            yield
        finally:
            self._current = prev

    @property
    def deferring(self) -> bool:
        return self._current is not None

    def push(self, fn: Callable[[], None]) -> None:
        self._queues[self._current].append(fn)

    def flush(self, mb: int) -> None:
        for fn in self._queues.pop(mb, []):
            fn()

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad_fn is not None:
        # a view of a flat parameter (ZeRO-3 points the module at slices of its gathered unit): send the
        # gradient through the view into the flat leaf, whose hooks accumulate it like any other
        torch.autograd.backward(p, g)
        return
    with torch.no_grad():  # the .grad of a ZeRO-1/2 or DDP parameter may be a view into its flat
        if p.grad is None:  # gradient bucket, which autograd forbids changing in place in grad mode
            p.grad = g
        else:
            p.grad += g


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        # The Parameters themselves, so a deferred W accumulates into their .grad.
        ctx.params, ctx.store, ctx.has_bias = (weight, bias), store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g_out):
        x, weight = ctx.saved_tensors
        g_x = g_out @ weight if ctx.needs_input_grad[0] else None
        want_w, want_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        if not (want_w or want_b):  # a frozen layer (LoRA's base): no weight gradient to defer
            return g_x, None, None, None

        def weight_grads():
            g2 = g_out.reshape(-1, g_out.shape[-1])
            g_w = g2.t() @ x.reshape(-1, x.shape[-1]) if want_w else None
            g_b = g2.sum(0) if want_b else None
            return g_w, g_b

        if ctx.store.deferring:
            w, b = ctx.params

            def later():
                g_w, g_b = weight_grads()
                if g_w is not None:
                    _accumulate(w, g_w)
                if g_b is not None:
                    _accumulate(b, g_b)
            ctx.store.push(later)
            return g_x, None, None, None
        g_w, g_b = weight_grads()
        return g_x, g_w, g_b, None


def split_linears(module: nn.Module, store: WeightGradStore) -> int:
    """Route every nn.Linear in ``module`` through the split backward (and hand ``store`` to modules with a
    ``weight_grad_store`` attribute); returns how many were patched."""
    n = 0
    adapter_parts = {id(part) for m in module.modules() if has_adapter(m) for part in (m.lora_A, m.lora_B)}
    for lin in module.modules():
        if id(lin) in adapter_parts:  # computed by its layer's lora_delta, never called as a module
            continue
        if hasattr(lin, "weight_grad_store"):  # a module that splits its own backward (see synthetic.py)
            lin.weight_grad_store = store
            n += 1
        elif isinstance(lin, nn.Linear):
            def forward(x, lin=lin):
                return _apply(x, lin, store)
            lin.forward = forward
            n += 1
    return n


def _apply(x: torch.Tensor, lin: nn.Linear, store: WeightGradStore) -> torch.Tensor:
    y = _SplitLinear.apply(x, lin.weight, lin.bias, store)
    if has_adapter(lin):  # LoRA: the adapter's own two small linears keep autograd's backward (B and W at once)
        y = y + lora_delta(lin, x)
    return y
