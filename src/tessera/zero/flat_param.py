"""ZeRO-3's sharded flat parameter: the parameters of one unit (and one optimizer param group) laid end
to end in a padded flat buffer of P elements, of which each rank keeps only its slice of n = P/N.

``full`` is an autograd leaf [P] in the compute dtype whose storage exists only while gathered: the
module's parameters are set to views of it before each use, so autograd accumulates their gradients
into ``full.grad``, and a post-accumulate hook on ``full`` fires once the whole unit's backward is done.
Freeing is ``storage.resize_(0)``: tensors autograd saved during forward keep pointing at the same
storage, which the backward all-gather refills in place (the same trick as torch FSDP). ``full`` is
created without storage (no [P] allocation at construction) and gets it at the first gather.

Where the shard's values come from. Real parameters (a model built whole): flattened to fp32 and
broadcast from global rank 0, so every replica starts from rank 0's weights. Meta parameters (a model
described on the meta device, each parameter carrying its initial-value origin,
``tessera.models.init``): this rank fills only its slice [rank·n, (rank+1)·n) of the padded buffer,
parameter by parameter, chunk by chunk, from the origins; the values equal one process's on every rank
by construction, so nothing is broadcast and no rank ever holds the unit, let alone the model.

Dtypes (``dtype`` = the compute dtype, e.g. bf16): ``shard.param`` [n] and the gathered ``full`` [P]
and its gradient ``full.grad`` [P] are in ``dtype`` (the all-gather moves 2 bytes per element in bf16);
``shard.master`` [n] is fp32 (the shard itself in fp32 without offload); the reduced ``shard.grad`` [n]
is in the reduce dtype.

Frozen (``trainable=False``: parameters that need no gradient, a LoRA job's base weights): sharded and
gathered like any other (they are most of the memory), but ``full`` is no autograd leaf, so no gradient
[P] ever exists, nothing is reduce-scattered and there is no master: ``shard.master`` is None and the
shard is held in ``dtype`` only (bf16: 2 bytes per element, no fp32 copy).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.models.init import origin_of
from tessera.zero.flat import flatten_fp32, offsets_of, padded_size, rank_slice
from tessera.zero.reduce import SliceReduction, accumulate
from tessera.zero.shards import Shard, make_master


class FlatParam:
    def __init__(self, entries: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], str]], group: int,
                 shard: CommGroup, replicate: CommGroup, device: torch.device, dtype: torch.dtype,
                 offload_device: torch.device | None, trainable: bool = True):
        params = [p for p, _, _ in entries]
        self.locations = [locs for _, locs, _ in entries]  # (owner module, attribute) per parameter
        self.names = [name for _, _, name in entries]
        self.shapes = [p.shape for p in params]
        self.offsets, total = offsets_of(params)
        self.group_shard, self.device, self.dtype = shard, device, dtype
        self.size = padded_size(total, shard.size)
        home = offload_device or device  # where the shard lives between uses
        with torch.no_grad():
            if any(p.is_meta for p in params):
                mine32 = self._shard_from_origins(params, home)
            else:
                mine32 = self._shard_from_broadcast(params, replicate)
        param_shard = mine32.to(home, dtype=dtype)  # mine32 itself when fp32 and already home
        master = None
        if trainable:
            master = make_master(param_shard if dtype == torch.float32 else mine32,
                                 None if dtype == torch.float32 else offload_device)
        self.trainable = trainable
        self.shard = Shard(group, param_shard, master)
        self.full = _without_storage(self.size, dtype, device).requires_grad_(trainable)
        self.pending = None  # handle of an in-flight all-gather
        self.gathered = False
        self.tally = None  # a LiveTally (tessera.zero.live) this flat adds its size to while gathered
        self.reduced = False  # its gradient's reduce-scatter was launched in the current backward
        for p, locs in zip(params, self.locations):
            for owner, attr in locs:
                owner._parameters.pop(attr, None)  # the module now holds views, set before each use
                setattr(owner, attr, None)

    def _shard_from_broadcast(self, params: list[torch.Tensor], replicate: CommGroup) -> torch.Tensor:
        """Real parameters: the whole unit in fp32 [P], global rank 0's everywhere; this rank's slice [n]."""
        flat32 = flatten_fp32(params, self.offsets, self.size)
        comm.broadcast(flat32, replicate, src=0)  # global rank 0's weights everywhere
        comm.broadcast(flat32, self.group_shard, src=0)
        return rank_slice(flat32, self.group_shard.rank, self.group_shard.size).clone()

    def _shard_from_origins(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Meta parameters: this rank's slice [n] (fp32, zeros in the padding) filled from the origins of
        the parameters that overlap it, one chunk at a time."""
        n = self.size // self.group_shard.size
        lo = self.group_shard.rank * n
        out = torch.zeros(n, dtype=torch.float32, device=device)
        for p, name, offset in zip(params, self.names, self.offsets):
            origin = origin_of(p)
            if not p.is_meta or origin is None:
                raise ValueError(f"ZeRO-3: parameter {name} must be on the meta device with an initial-value "
                                 f"origin like the rest of its unit (tessera.models.init)")
            a, b = max(offset, lo), min(offset + p.numel(), lo + n)
            if a < b:
                origin.fill_(out[a - lo : b - lo], start=a - offset)
        return out

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
        source = (self.shard.param.to(self.device, non_blocking=True) if self.shard.copies is None
                  else self.shard.copies.to_device(self.shard.param))  # host offload: on a side stream
        # .data: writing the gathered values must not bump the version counter autograd checks
        self.pending = comm.all_gather(self.full.data, source, self.group_shard, async_op=True)
        self.gathered = True
        if self.tally is not None:
            self.tally.numel += self.size
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
            if self.tally is not None:
                self.tally.numel -= self.size

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


def _without_storage(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [size] tensor whose storage holds 0 bytes until ``untyped_storage().resize_``. Not ``set_``:
    it grows the storage to the size (an allocation of the whole unit); a view op with explicit sizes
    does not check the storage's bounds, and ``detach`` makes it a leaf of its own."""
    empty = torch.empty(0, dtype=dtype, device=device)
    return torch.ops.aten._reshape_alias(empty, (size,), (1,)).detach()
