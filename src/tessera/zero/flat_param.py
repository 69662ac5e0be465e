"""ZeRO-3's sharded flat parameter: the parameters of one unit (and one optimizer param group) laid end
to end in a padded flat buffer of P elements, of which each rank keeps only its slice of n = P/N.

``full`` is an autograd leaf [P] in the compute dtype whose storage exists only while gathered: the
module's parameters are set to views of it before each use, so autograd accumulates their gradients
into ``full.grad``, and a post-accumulate hook on ``full`` fires once the whole unit's backward is done.
Freeing is ``storage.resize_(0)``: tensors autograd saved during forward keep pointing at the same
storage, which the backward all-gather refills in place (the same trick as torch FSDP).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.zero.flat import flatten_fp32, offsets_of, padded_size, rank_slice
from tessera.zero.reduce import SliceReduction, accumulate
from tessera.zero.shards import Shard, make_master


class FlatParam:
    def __init__(self, entries: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], str]], group: int,
                 shard: CommGroup, replicate: CommGroup, device: torch.device, dtype: torch.dtype,
                 offload_device: torch.device | None):
        params = [p for p, _, _ in entries]
        self.locations = [locs for _, locs, _ in entries]  # (owner module, attribute) per parameter
        self.names = [name for _, _, name in entries]
        self.shapes = [p.shape for p in params]
        self.offsets, total = offsets_of(params)
        self.group_shard, self.device, self.dtype = shard, device, dtype
        with torch.no_grad():
            flat32 = flatten_fp32(params, self.offsets, padded_size(total, shard.size))
            comm.broadcast(flat32, replicate, src=0)  # global rank 0's weights everywhere
            comm.broadcast(flat32, shard, src=0)
            mine32 = rank_slice(flat32, shard.rank, shard.size).clone()
        home = offload_device or device  # where the shard lives between uses
        param_shard = mine32.to(home, dtype=dtype, copy=dtype != torch.float32 or home != device)
        master = make_master(param_shard if dtype == torch.float32 else mine32,
                             None if dtype == torch.float32 else offload_device)
        self.shard = Shard(group, param_shard, master)
        self.size = flat32.numel()
        self.full = torch.empty(self.size, dtype=dtype, device=device).requires_grad_(True)
        self._free()
        self.pending = None  # handle of an in-flight all-gather
        self.gathered = False
        self.reduced = False  # its gradient's reduce-scatter was launched in the current backward
        for p, locs in zip(params, self.locations):
            for owner, attr in locs:
                owner._parameters.pop(attr, None)  # the module now holds views, set before each use
                setattr(owner, attr, None)

    # ---- gather / free -------------------------------------------------------------------------
    def _free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def gather(self, async_op: bool = False) -> None:
        """All-gather the full parameters into ``full`` (allocating its storage); idempotent."""
        if self.gathered:
            if not async_op:
                self.wait()
            return
        self.full.untyped_storage().resize_(self.size * self.full.element_size())
        source = self.shard.param.to(self.device, non_blocking=True)
        # .data: writing the gathered values must not bump the version counter autograd checks
        self.pending = comm.all_gather(self.full.data, source, self.group_shard, async_op=True)
        self.gathered = True
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def reshard(self) -> None:
        if self.gathered:
            self.wait()
            self._free()
            self.gathered = False

    def use_views(self) -> None:
        """Point every owning module attribute at its slice of ``full`` (creates autograd views; with grad
        enabled even inside backward, so a checkpoint's recomputation saves what the forward saved)."""
        with torch.enable_grad():
            self._set_views()

    def _set_views(self) -> None:
        for shape, offset, locs in zip(self.shapes, self.offsets, self.locations):
            view = self.full[offset : offset + shape.numel()].view(shape)
            for owner, attr in locs:
                setattr(owner, attr, view)

    # ---- gradients ---------------------------------------------------------------------------------
    def launch_reduce(self, grad: torch.Tensor | None, reduction: SliceReduction):
        """Start the reduction of a full gradient [P] (zeros if None) into this rank's slice; returns
        the pending state for ``reduction.finish``."""
        if grad is None:
            grad = torch.zeros(self.size, dtype=reduction.dtype, device=self.device)
        return reduction.start(grad)

    def keep_grad(self, out: torch.Tensor) -> None:
        """Accumulate a reduced gradient slice (moved to the shard's home when offloading)."""
        accumulate(self.shard, out)

    def full_values(self) -> dict[str, torch.Tensor]:
        """name → full parameter (a collective: gathers, copies out, frees unless already gathered)."""
        was = self.gathered
        self.gather()
        out = {n: self.full.detach()[o : o + s.numel()].view(s).clone()
               for n, o, s in zip(self.names, self.offsets, self.shapes)}
        if not was:
            self.reshard()
        return out
