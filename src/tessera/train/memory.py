"""MemoryLedger: bytes a rank holds, counted from live tensors.

Categories: parameters, gradients, optimizer states and the activations saved for backward (frozen
parameters, a LoRA job's base weights, count as parameters and have neither gradients nor optimizer
state, so those two follow the trainable parameters). Tensors are
deduplicated by storage (a gradient that is a view into a communication bucket counts the whole bucket
once; tied weights count once), so the numbers are what the process really holds. The peak resident set
of the process and, on an accelerator, its peak allocation come with them.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from dataclasses import asdict, dataclass

import torch
from torch import nn


def storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr())


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None):
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass
class MemorySnapshot:
    params: int
    grads: int
    optimizer: int
    activations: int  # peak bytes saved for backward in the last measured forward
    peak_rss: int
    peak_device: int  # peak accelerator allocation; 0 on CPU

    def as_dict(self) -> dict:
        return asdict(self)


class MemoryLedger:
    """Counts one rank's memory. ``track_activations()`` wraps a forward to measure saved tensors."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, grad_buffers=(),
                 state_fn=None):
        self.model = model
        self.optimizer = optimizer
        self.grad_buffers = list(grad_buffers)  # tensors a wrapper holds gradients in (DDP's buckets)
        # a sharded engine's ``memory_tensors``: {"params", "grads", "optimizer"} → the tensors it holds
        # (shards, flat buffers, fp32 masters); replaces counting through model and optimizer
        self.state_fn = state_fn
        self.activation_bytes = 0

    def model_state(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state (masters included) this rank holds."""
        if self.state_fn is not None:
            held = self.state_fn()
            # + the model's own parameters: those no engine took (frozen ones left whole by ZeRO-0/1/2; the
            # others are views of the engine's buffers, counted once by storage)
            held["params"] = list(held["params"]) + list(self.model.parameters())
            return {k: storage_bytes(held[k]) for k in ("params", "grads", "optimizer")}
        params = list(self.model.parameters())
        return {"params": storage_bytes(params),
                "grads": storage_bytes([p.grad for p in params] + self.grad_buffers),
                "optimizer": storage_bytes(_optimizer_tensors(self.optimizer))}

    def _param_keys(self) -> set:
        keys = {storage_key(p) for p in self.model.parameters()}
        if self.state_fn is not None:  # gathered ZeRO-3 parameters live in storages allocated per use
            keys |= {storage_key(t) for t in self.state_fn()["params"] if t is not None}
        return keys

    def snapshot(self, peak_device: int | None = None) -> MemorySnapshot:
        state = self.model_state()
        return MemorySnapshot(
            params=state["params"],
            grads=state["grads"],
            optimizer=state["optimizer"],
            activations=self.activation_bytes,
            peak_rss=peak_rss_bytes(),
            peak_device=peak_device or 0,
        )

    @contextlib.contextmanager
    def track_activations(self):
        """Count the distinct storages autograd saves for backward (parameters excluded) while inside.

        The pack hook returns the tensor unchanged, so training is not altered.
        """
        param_keys = self._param_keys()
        saved: dict[tuple, int] = {}

        def pack(t: torch.Tensor):
            key = storage_key(t)
            if key not in param_keys and (self.state_fn is None or key not in self._param_keys()):
                saved.setdefault(key, t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.activation_bytes = sum(saved.values())
