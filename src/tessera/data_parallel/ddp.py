"""Distributed data parallel: one replica per rank, gradients all-reduced in buckets during backward.

Forward communication: none (parameters and buffers are broadcast from the group's rank 0 once, at
construction). Backward communication: one all-reduce per gradient bucket, launched asynchronously from
the gradient hooks the moment its bucket is full, strictly in bucket order on every rank, so it overlaps
the rest of backward; at the end of backward the remaining buckets are launched and all are waited for
(the mechanism, shared with ZeRO, is ``tessera.data_parallel.reducer``). Total per step:
2(N-1)/N × gradient bytes per rank (ring all-reduce).

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

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.data_parallel.buckets import Bucket, build_buckets
from tessera.data_parallel.reducer import AllReduce, GradReducer


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
        reduction = AllReduce(group, reduce_op)
        self.module = module
        self.group = group
        self.broadcast_buffers = broadcast_buffers
        params = [p for p in (module.parameters() if parameters is None else parameters) if p.requires_grad]
        # a group of one reduces nothing: no buckets, so no flat buffer beside the gradients, no hooks
        buckets = (build_buckets(list(reversed(params)), int(bucket_mb * 2**20), fill_to_cap=True)
                   if group.size > 1 else [])
        for bucket in buckets:
            bucket.allocate()  # persistent: after the first step every gradient is a view into one
        self.reducer = GradReducer(buckets, reduction, hooks=bool(buckets),
                                   find_unused=find_unused_parameters, group=group)
        if group.size > 1:
            self._broadcast_state()

    @property
    def buckets(self) -> list[Bucket]:
        return self.reducer.buckets

    @property
    def grad_buffers(self) -> list[torch.Tensor]:
        """The flat bucket buffers; after the first step they hold every parameter's gradient."""
        return [b.buffer for b in self.buckets]

    @property
    def early_launches(self) -> int:
        """Buckets of the last backward whose all-reduce started from a gradient hook (overlapped)."""
        return self.reducer.early_launches

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block reduces the total."""
        return self.reducer.no_sync()

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
