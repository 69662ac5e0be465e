"""Keep only the sequence slice of a gathered activation for backward (Megatron SP's memory saving).

Under sequence parallelism a region starts with an all-gather of x [B, S/N, D] into [B, S, D]; the linear
layers that read it would save the full tensor for their weight gradients, an sbh term that does not
shrink with N. While the region's module runs forward, saved-tensor hooks replace any saved tensor that
lives in the gathered storage by a note of this rank's slice; in backward the first use all-gathers it
again (one extra all-gather of B·S·D per region) and the other uses (wq, wk, wv) share that copy.

Hooks already active outside (activation checkpointing, ``MemoryLedger.track_activations``) still see
every other saved tensor, and see the slice once in place of the gathered tensor, so they compose.
"""

from __future__ import annotations

import torch

from tessera.comm.group import CommGroup
from tessera.tensor_parallel.regions import _all_gather_dim


def _outer_hooks():
    """The saved-tensor hooks active right now (outermost context), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    return hooks if hooks and hooks[0] is not None else None


class _Note:
    """Stands for a saved view of the gathered tensor: its shape, stride and offset."""

    def __init__(self, t: torch.Tensor):
        self.geometry = (t.shape, t.stride(), t.storage_offset())


class _Outer:
    def __init__(self, packed):
        self.packed = packed


class RegatherOnBackward:
    """Saved-tensor hooks for one forward of one region: ``full`` is the gathered tensor (contiguous),
    ``local`` the slice this rank holds (along ``dim``)."""

    # Never traced: under kernels.compile dynamo would pin the storage address in a guard and recompile
    # for every new activation.
    @torch.compiler.disable
    def __init__(self, full: torch.Tensor, local: torch.Tensor, group: CommGroup, dim: int):
        self.key = full.untyped_storage().data_ptr()
        self.local, self.group, self.dim = local.detach(), group, dim
        self.outer = _outer_hooks()
        self.local_handle = None  # what the outer hooks made of the slice (they account for it)
        self.pending = 0  # saved references not yet unpacked; the cached copy is dropped at 0
        self.cache: torch.Tensor | None = None
        self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() != self.key:
            return _Outer(self.outer[0](t)) if self.outer else t
        if self.outer and self.local_handle is None:
            self.local_handle = self.outer[0](self.local)
        self.pending += 1
        return _Note(t)

    def unpack(self, packed):
        if isinstance(packed, _Outer):
            return self.outer[1](packed.packed)
        if not isinstance(packed, _Note):
            return packed
        if self.cache is None:
            with torch.no_grad():
                self.cache = _all_gather_dim(self.local, self.group, self.dim).contiguous()
        out = self.cache.as_strided(*packed.geometry)
        self.pending -= 1
        if self.pending <= 0:
            self.cache, self.pending = None, 0
        return out
