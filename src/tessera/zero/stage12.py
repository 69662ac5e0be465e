"""ZeRO-1 and ZeRO-2: sharded optimizer state (and gradients) over ``dp_shard``.

Parameters are laid into flat buckets (``tessera.data_parallel.buckets``: reverse order of the param
groups' parameters, one optimizer param group per bucket, each padded to a multiple of N = dp_shard) and
become views into them; every rank holds the full compute-dtype parameters. Rank r owns slice r of every
bucket: its fp32 master weights and optimizer state exist only there (1/N each).

Forward communication: none. Backward communication: one reduce-scatter (sum) per bucket over
``dp_shard``, launched from the gradient hooks as soon as the bucket is full (in one fixed order on every
rank: the order backward is expected to fill the buckets), then, with hybrid sharding, an all-reduce of
the slice over ``dp_replicate`` — the data-parallel reducer (``tessera.data_parallel.reducer``) with
ZeRO's reduction (``tessera.zero.reduce``). After the step: the all-gather of the updated slices, one
per reduce bucket or in all-gather buckets of their own size (``tessera.zero.gather``). Per step
(N-1)/N·S + (N-1)/N·S = DDP's all-reduce.

ZeRO-1 reduces once per optimizer step (``no_sync`` accumulates micro-batches in the full local
gradients), keeps the reduced slice and frees the full gradient buffers once reduced (the next
synchronised backward makes new ones), so between steps it holds only the slice. ZeRO-2 reduces every backward into a
persistent gradient slice and frees each bucket's full gradient once its reduce-scatter is done
(completed when the next bucket launches; buckets launch in the order backward fills them, so about two
buckets of full gradients exist at a time, plus, with a second param group, its small bucket of vectors,
which fills from the last layer to the first).
With ``shard`` of size 1 and ``replicate`` = the dp group this is plain DDP with master weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.data_parallel.buckets import Bucket, build_buckets, in_arrival_order
from tessera.data_parallel.reducer import GradReducer
from tessera.zero.flat import flatten_fp32, rank_slice, slice_segments
from tessera.zero.gather import ParamGather
from tessera.zero.reduce import SliceReduction, ZeroReduction
from tessera.zero.shards import Shard, ShardedUpdate, make_master


@dataclass(eq=False)
class FlatBucket:
    """One bucket's parameters: ``grads`` is its gradient bucket (the reducer's), ``flat`` [P] the
    compute-dtype parameters (views into it), ``shard`` this rank's slice with its master weights."""

    grads: Bucket
    flat: torch.Tensor
    shard: Shard

    @property
    def params(self) -> list[nn.Parameter]:
        return self.grads.params

    @property
    def offsets(self) -> list[int]:
        return self.grads.offsets


class ZeroDataParallel(nn.Module):
    """ZeRO stage 1 or 2 around ``module``. ``param_groups`` are torch-style dicts ({"params": [...],
    other options}); ``make_optimizer(groups)`` builds any elementwise torch optimizer.

    Under tensor parallelism each tp rank runs its own engine over its own slices of the weights;
    ``norm_axes`` (e.g. ``{"tp": group}``) and ``param_axes(p) -> frozenset`` (the axes among them that
    ``p`` is split on) make the clipping norm count every element of the job once. ``hooks=False``: no
    reduction during backward, only :meth:`reduce_gradients` (a pipeline schedule's many backwards).
    ``allgather_bucket_mb``: bytes gathered per all-gather after the step (0: one per reduce bucket)."""

    def __init__(self, module: nn.Module, param_groups: list[dict], make_optimizer, shard: CommGroup,
                 replicate: CommGroup, stage: int, bucket_mb: float = 25.0,
                 param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype | None = None,
                 offload_device: torch.device | None = None, norm_axes: dict[str, CommGroup] | None = None,
                 param_axes=None, hooks: bool = True, allgather_bucket_mb: float = 0.0):
        super().__init__()
        self._param_axes = param_axes
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, got {stage}")
        self.module, self.stage = module, stage
        self.shard_group, self.replicate_group = shard, replicate
        self.reduce_dtype = reduce_dtype or param_dtype
        group_of = {id(p): g for g, grp in enumerate(param_groups) for p in grp["params"]}
        order = [p for grp in param_groups for p in grp["params"]]
        grads = build_buckets(list(reversed(order)), int(bucket_mb * 2**20), lambda p: group_of[id(p)],
                              pad_to=shard.size)
        self.buckets = [self._make_bucket(b, param_dtype, offload_device) for b in grads]
        self.gather = ParamGather([b.flat for b in self.buckets], [b.shard.param for b in self.buckets], shard,
                                  int(allgather_bucket_mb * 2**20) if allgather_bucket_mb > 0 else None)
        options = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        self.update = ShardedUpdate([b.shard for b in self.buckets], options, make_optimizer, shard,
                                    [shard, replicate, *(norm_axes or {}).values()],
                                    self.buckets[0].flat.device if self.buckets else shard.device, norm_axes)
        self.optimizer = self.update.optimizer
        self.reduction = ZeroReduction(stage, SliceReduction(shard, replicate, self.reduce_dtype),
                                       {b.grads: b.shard for b in self.buckets})
        # launched as backward fills them (not by group): overlap, and ZeRO-2 frees as it goes
        self.reducer = GradReducer(in_arrival_order(grads, list(reversed(list(module.parameters())))),
                                   self.reduction, hooks=hooks)

    @torch.no_grad()
    def _make_bucket(self, grads: Bucket, dtype, offload_device) -> FlatBucket:
        params, offsets = grads.params, grads.offsets
        flat32 = flatten_fp32(params, offsets, grads.size)
        # every replica starts from global rank 0's weights: first across replicas, then across shards
        comm.broadcast(flat32, self.replicate_group, src=0)
        comm.broadcast(flat32, self.shard_group, src=0)
        flat = flat32 if dtype == torch.float32 else flat32.to(dtype)
        for p, o in zip(params, offsets):
            p.data = flat[o : o + p.numel()].view_as(p)
        n = self.shard_group.rank
        param_slice = rank_slice(flat, n, self.shard_group.size)
        # mixed precision: the master starts from the fp32 values (a copy, so flat32 can be freed)
        master = make_master(rank_slice(flat32, n, self.shard_group.size).clone() if flat is not flat32
                             else param_slice, offload_device)
        shard = Shard(grads.param_group, param_slice, master)
        if self._param_axes is not None:
            shard.segments = slice_segments(offsets, [p.numel() for p in params],
                                            [frozenset(self._param_axes(p)) for p in params], n,
                                            self.shard_group.size, flat.numel())
        return FlatBucket(grads, flat, shard)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """ZeRO-1: accumulate full local gradients; the next synchronised backward reduces them.
        ZeRO-2 keeps no full gradients to accumulate into: it reduces every backward (a no-op here)."""
        return self.reducer.no_sync()

    def reduce_gradients(self) -> None:
        """Reduce gradients accumulated by backwards the hooks did not see (a pipeline schedule runs
        many per step): the same reduce-scatters as a synchronised backward."""
        self.reducer.reduce_gradients()

    # ---- the step ------------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float, inv_scale: float = 1.0) -> tuple[float, bool]:
        """Unscale, check finiteness on every rank and clip by the global norm: (norm, finite)."""
        finite = self.update.prepare_grads(inv_scale)
        norm = self.update.clip(max_norm) if finite else float("inf")
        return norm, finite

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's slices, then all-gather every bucket's parameters."""
        self.update.step()
        self.gather_params()

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's full parameters from the owners' slices (``tessera.zero.gather``)."""
        self.gather.run()

    def zero_grad(self) -> None:
        self.update.zero_grad()
        for b in self.buckets:
            b.grads.buffer = None  # normally gone already: dropped once reduced
            if self.stage == 1:  # micro-batches accumulated under no_sync and never reduced
                for p in b.params:
                    p.grad = None
        self.reduction.reduced = False

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = self.update.tensors()
        out["params"] = [b.flat for b in self.buckets]
        out["grads"] = [b.grads.buffer for b in self.buckets] + out["grads"]
        if self.stage == 1:  # full gradients accumulated under no_sync, before their reduction
            out["grads"] += [p.grad for b in self.buckets for p in b.params if p.grad is not None]
        return out

    def flat_shards(self) -> list[tuple[torch.Tensor, int, list[tuple[str, tuple, int]]]]:
        """Per bucket: (fp32 master slice [n], this rank's index in the shard group, [(parameter name in
        ``module``, shape, offset in the bucket)]) — what a checkpoint cuts into per-parameter pieces."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [(b.shard.master, self.shard_group.rank,
                 [(names[id(p)], tuple(p.shape), o) for p, o in zip(b.params, b.offsets)]) for b in self.buckets]

    def full_parameters(self) -> dict[int, torch.Tensor]:
        """id(parameter) → its full value (every rank holds them all in ZeRO-1/2)."""
        return {id(p): p.detach() for b in self.buckets for p in b.params}
