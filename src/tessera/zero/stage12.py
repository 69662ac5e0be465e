"""ZeRO-1 and ZeRO-2: sharded optimizer state (and gradients) over ``dp_shard``.

Parameters are laid into flat buckets (reverse registration order, one optimizer param group per
bucket, each padded to a multiple of N = dp_shard) and become views into them; every rank holds the
full compute-dtype parameters. Rank r owns slice r of every bucket: its fp32 master weights and
optimizer state exist only there (1/N each).

Forward communication: none. Backward communication: one reduce-scatter (sum) per bucket over
``dp_shard``, launched from the gradient hooks as soon as the bucket is full (in bucket order on every
rank), then, with hybrid sharding, an all-reduce of the slice over ``dp_replicate``. After the step:
one all-gather per bucket of the updated slices. Per step (N-1)/N·S + (N-1)/N·S = DDP's all-reduce.

ZeRO-1 keeps the full gradient buffers (its reduced slice is a view into them) and reduces once per
optimizer step (``no_sync`` accumulates micro-batches locally). ZeRO-2 reduces every backward into a
persistent gradient slice and frees each bucket's full gradient once its reduce-scatter is done
(completed when the next bucket launches, so only about two buckets of full gradients exist at a time).
With ``shard`` of size 1 and ``replicate`` = the dp group this is plain DDP with master weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.zero.flat import flatten_fp32, offsets_of, padded_size, rank_slice, slice_segments
from tessera.zero.shards import Shard, ShardedUpdate, make_master


@dataclass(eq=False)
class FlatBucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor  # [P] compute dtype; the parameters are views into it
    shard: Shard
    grad_buf: torch.Tensor | None = None  # [P] compute dtype; full local gradients while held
    used: set[int] = field(default_factory=set)
    pending: tuple | None = None  # (handle, output slice, input) of the in-flight reduce-scatter

    def grad_view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.grad_buf[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


def build_flat_buckets(param_groups: list[list[nn.Parameter]], cap_bytes: int) -> list[tuple[int, list]]:
    """(group index, params) per bucket: parameters in reverse order of the flattened groups' order,
    a new bucket when the group changes or the cap would be passed."""
    order = [(g, p) for g, ps in enumerate(param_groups) for p in ps]
    buckets: list[tuple[int, list]] = []
    size = 0
    for g, p in reversed(order):
        nb = p.numel() * p.element_size()
        if not buckets or buckets[-1][0] != g or (buckets[-1][1] and size + nb > cap_bytes):
            buckets.append((g, []))
            size = 0
        buckets[-1][1].append(p)
        size += nb
    return buckets


class ZeroDataParallel(nn.Module):
    """ZeRO stage 1 or 2 around ``module``. ``param_groups`` are torch-style dicts ({"params": [...],
    other options}); ``make_optimizer(groups)`` builds any elementwise torch optimizer.

    Under tensor parallelism each tp rank runs its own engine over its own slices of the weights;
    ``norm_axes`` (e.g. ``{"tp": group}``) and ``param_axes(p) -> frozenset`` (the axes among them that
    ``p`` is split on) make the clipping norm count every element of the job once."""

    def __init__(self, module: nn.Module, param_groups: list[dict], make_optimizer, shard: CommGroup,
                 replicate: CommGroup, stage: int, bucket_mb: float = 25.0,
                 param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype | None = None,
                 offload_device: torch.device | None = None, norm_axes: dict[str, CommGroup] | None = None,
                 param_axes=None):
        super().__init__()
        self._param_axes = param_axes
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, got {stage}")
        self.module, self.stage = module, stage
        self.shard_group, self.replicate_group = shard, replicate
        self.reduce_dtype = reduce_dtype or param_dtype
        self._sync, self._queued, self._next_launch, self._reduced = True, False, 0, False
        groups = [list(g["params"]) for g in param_groups]
        self.buckets = [self._make_bucket(i, g, ps, param_dtype, offload_device)
                        for i, (g, ps) in enumerate(build_flat_buckets(groups, int(bucket_mb * 2**20)))]
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        options = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        self.update = ShardedUpdate([b.shard for b in self.buckets], options, make_optimizer, shard,
                                    [shard, replicate], self.buckets[0].flat.device, norm_axes)
        self.optimizer = self.update.optimizer
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @torch.no_grad()
    def _make_bucket(self, index, group, params, dtype, offload_device) -> FlatBucket:
        offsets, total = offsets_of(params)
        flat32 = flatten_fp32(params, offsets, padded_size(total, self.shard_group.size))
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
        shard = Shard(group, param_slice, master)
        if self._param_axes is not None:
            shard.segments = slice_segments(offsets, [p.numel() for p in params],
                                            [frozenset(self._param_axes(p)) for p in params], n,
                                            self.shard_group.size, flat.numel())
        return FlatBucket(index, params, offsets, flat, shard)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """ZeRO-1 only: accumulate full local gradients; the next synchronised backward reduces them."""
        if self.stage != 1:
            yield  # ZeRO-2 keeps no full gradients to accumulate into: it reduces every backward
            return
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ---- backward ------------------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._queued:
            if self.stage == 1 and self._reduced:
                raise RuntimeError("ZeRO-1 reduces gradients once per optimizer step; accumulate "
                                   "micro-batches inside no_sync() and synchronise only the last one")
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket, i = self._slot[id(p)]
        self._take(bucket, i, p)
        self._launch_ready()

    @torch.no_grad()
    def _take(self, bucket: FlatBucket, i: int, p: nn.Parameter) -> None:
        """Move p's gradient into its bucket slot (ZeRO-1: p.grad becomes the slot; ZeRO-2: freed)."""
        if bucket.grad_buf is None:
            bucket.grad_buf = torch.zeros_like(bucket.flat)
        view = bucket.grad_view(i)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view if self.stage == 1 else None
        bucket.used.add(i)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.used) < len(b.params):
                return
            self._launch(b)
            if self.stage == 2 and self._next_launch > 0:
                # ZeRO-2: the previous bucket's reduce-scatter had this bucket's backward to finish in;
                # complete it now so its full gradient is freed while backward goes on
                self._complete(self.buckets[self._next_launch - 1])
            self._next_launch += 1

    def _launch(self, b: FlatBucket) -> None:
        src = b.grad_buf if b.grad_buf.dtype == self.reduce_dtype else b.grad_buf.to(self.reduce_dtype)
        out = torch.empty(src.numel() // self.shard_group.size, dtype=self.reduce_dtype, device=src.device)
        handle = comm.reduce_scatter(out, src, self.shard_group, op="sum", async_op=True)
        b.pending = (handle, out, src)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """Reduce buckets no hook completed (unused parameters count as zeros), wait for every
        reduce-scatter in bucket order, all-reduce slices across replicas, keep this rank's slice."""
        for b in self.buckets[self._next_launch :]:
            for i, p in enumerate(b.params):
                if i not in b.used:
                    self._take(b, i, p)
        self._launch_ready()
        for b in self.buckets:
            if b.pending is not None:
                self._complete(b)
            b.used.clear()
        self._next_launch, self._queued = 0, False
        self._reduced = self.stage == 1

    def reduce_gradients(self) -> None:
        """Reduce gradients accumulated inside ``no_sync()`` by backwards the hooks did not see (a
        pipeline schedule runs many per step): the same reduce-scatters as a synchronised backward."""
        self._finish_backward()

    def _complete(self, b: FlatBucket) -> None:
        """Wait for a bucket's reduce-scatter, all-reduce the slice across replicas, keep it."""
        handle, out, _ = b.pending
        handle.wait()
        comm.all_reduce(out, self.replicate_group, op="sum")
        self._keep(b, out)
        b.pending = None

    def _keep(self, b: FlatBucket, out: torch.Tensor) -> None:
        if self.stage == 1:  # the reduced slice lives inside the full buffer: no extra copy held
            mine = rank_slice(b.grad_buf, self.shard_group.rank, self.shard_group.size)
            mine.copy_(out)
            b.shard.grad = mine
        else:
            if b.shard.grad is None:
                b.shard.grad = out
            else:
                b.shard.grad.add_(out)
            b.grad_buf = None  # ZeRO-2: the full gradient is gone as soon as it is reduced

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
        """Every rank's full parameters from the owners' slices (one all-gather per bucket)."""
        handles = []
        for b in self.buckets:
            handles.append(comm.all_gather(b.flat, b.shard.param.clone(), self.shard_group, async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        self.update.zero_grad()
        for b in self.buckets:
            if b.grad_buf is not None:
                b.grad_buf.zero_()
        self._reduced = False

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = self.update.tensors()
        out["params"] = [b.flat for b in self.buckets]
        out["grads"] = [b.grad_buf for b in self.buckets] + out["grads"]
        return out

    def full_parameters(self) -> dict[int, torch.Tensor]:
        """id(parameter) → its full value (every rank holds them all in ZeRO-1/2)."""
        return {id(p): p.detach() for b in self.buckets for p in b.params}
