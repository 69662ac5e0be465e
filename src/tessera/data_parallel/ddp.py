"""Distributed data parallel: one replica per rank, gradients all-reduced in buckets during backward.

Forward communication: none (parameters and buffers are broadcast from the group's rank 0 once, at
construction). Backward communication: one all-reduce per gradient bucket, launched asynchronously from
the gradient hooks the moment its bucket is full, so it overlaps the rest of backward; buckets are
launched strictly in index order on every rank ("reduce order kept"), whatever order the hooks fire in,
so the collectives always match across ranks. At the end of backward the remaining buckets are launched
and all are waited for. Total per step: 2(N-1)/N × gradient bytes per rank (ring all-reduce).

Parameters that receive no gradient in a pass ("skip gradient") contribute what they hold (a gradient
accumulated under ``no_sync``, or zeros); they never block a bucket forever and never cause a hang.
With ``find_unused_parameters=True`` one more small all-reduce counts, per parameter, the ranks that
hold a gradient for it, and a parameter no rank has one for keeps ``grad = None``,
exactly as in a single process (so optimizers skip it). Inside ``no_sync()`` gradients only accumulate
locally; the next synchronised backward reduces the accumulated sum, so every gradient is averaged
exactly once.

After the first synchronised step every ``param.grad`` is a view into its bucket (no copy on later
steps unless the optimizer sets gradients to None).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.data_parallel.buckets import Bucket, build_buckets


class DistributedDataParallel(nn.Module):
    """Wraps ``module``; ``group`` is the data-parallel CommGroup its replicas span.

    ``reduce_op``: "avg" divides the summed gradients by the group size (each rank's loss is a local
    mean); "sum" leaves them summed (each rank's loss is already divided by the global token count).
    ``parameters``: the subset of the module's parameters this instance replicates over ``group``
    (default: all that require grad), so that different parameters can be reduced over different
    groups (expert parallelism); ``broadcast_buffers`` also makes buffers and frozen parameters equal.
    """

    def __init__(self, module: nn.Module, group: CommGroup, bucket_mb: float = 25.0,
                 find_unused_parameters: bool = False, reduce_op: str = "avg", parameters=None,
                 broadcast_buffers: bool = True):
        super().__init__()
        if reduce_op not in ("avg", "sum"):
            raise ValueError(f"reduce_op must be 'avg' or 'sum', got '{reduce_op}'")
        self.module = module
        self.group = group
        self.reduce_op = reduce_op
        self.find_unused_parameters = find_unused_parameters
        self._sync = True
        self._callback_queued = False
        self.broadcast_buffers = broadcast_buffers
        params = [p for p in (module.parameters() if parameters is None else parameters) if p.requires_grad]
        # a group of one reduces nothing: no buckets, so no flat buffer beside the gradients
        self.buckets: list[Bucket] = (build_buckets(list(reversed(params)), int(bucket_mb * 2**20))
                                      if group.size > 1 else [])
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next_launch = 0
        self._in_finish = False
        # buckets whose all-reduce started from a gradient hook, i.e. overlapped with the rest of the
        # last backward (the others started at its end): a measure of achieved overlap
        self.early_launches = 0
        if group.size > 1:
            self._broadcast_state()
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @property
    def grad_buffers(self) -> list[torch.Tensor]:
        """The flat bucket buffers; after the first step they hold every parameter's gradient."""
        return [b.buffer for b in self.buckets]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block reduces the total."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ---- set-up --------------------------------------------------------------------------------
    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Make every replica start from rank 0's parameters and buffers (coalesced per bucket)."""
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                bucket.view(i).copy_(p)
            comm.broadcast(bucket.buffer, self.group, src=0)
            for i, p in enumerate(bucket.params):
                p.copy_(bucket.view(i))
            bucket.buffer.zero_()
        if not self.broadcast_buffers:
            return
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        tensors = frozen + [b for b in self.module.buffers()]
        for t in tensors:  # buffers are few and small; one message each keeps this simple
            comm.broadcast(t.data, self.group, src=0)

    # ---- backward ------------------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            self.early_launches = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket, i = self._slot[id(p)]
        if id(p) in bucket.used:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} received a second gradient in one backward pass; "
                "data parallelism reduces each gradient once per pass (run the pieces in one backward)"
            )
        self._take(bucket, i, p)
        bucket.ready += 1
        self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        """Launch buckets in index order only: bucket k waits for buckets < k, on every rank alike."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].full:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        if not self._in_finish:
            self.early_launches += 1
        bucket.handle = comm.all_reduce(bucket.buffer, self.group, op=self.reduce_op, async_op=True)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End of backward: move any gradient that no hook delivered this pass (accumulated under
        ``no_sync``) into its slot, zero the slots of parameters without one, launch the remaining
        buckets in order, wait for everything, then give ``grad = None`` back to parameters no rank
        has a gradient for (with ``find_unused_parameters``)."""
        self._in_finish = True
        for bucket in self.buckets[self._next_launch :]:
            for i, p in enumerate(bucket.params):
                if id(p) not in bucket.used:
                    self._adopt(bucket, i, p)
            bucket.ready = len(bucket.params)
        self._launch_full_buckets()
        counts = self._count_holders() if self.find_unused_parameters else None
        for bucket in self.buckets:
            bucket.handle.wait()
        self._assign_grads(counts)
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0
        self._callback_queued = False
        self._in_finish = False

    @staticmethod
    def _take(bucket: Bucket, i: int, p: nn.Parameter) -> None:
        """Make ``p.grad`` its bucket slot (copying a fresh gradient in) and count it as present."""
        view = bucket.view(i)
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        bucket.used.add(id(p))

    @classmethod
    def _adopt(cls, bucket: Bucket, i: int, p: nn.Parameter) -> None:
        """A parameter no hook delivered: its held gradient (from ``no_sync`` steps), or zeros."""
        if p.grad is None:
            bucket.view(i).zero_()
        else:
            cls._take(bucket, i, p)

    def _count_holders(self) -> torch.Tensor:
        """How many ranks hold a gradient for each parameter (one small all-reduce, after the buckets)."""
        held = [float(id(p) in b.used) for b in self.buckets for p in b.params]
        counts = torch.tensor(held, dtype=torch.float32, device=self.buckets[0].buffer.device)
        comm.all_reduce(counts, self.group)
        return counts

    def _assign_grads(self, counts: torch.Tensor | None) -> None:
        holders = counts.tolist() if counts is not None else None
        k = 0
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if holders is not None and holders[k] == 0:
                    p.grad = None
                elif p.grad is None:  # no gradient here, but the reduced one from the other ranks
                    p.grad = bucket.view(i)
                k += 1
