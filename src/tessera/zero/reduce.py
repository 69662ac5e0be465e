"""The gradient reduction of every ZeRO stage: a flat gradient [P] becomes this rank's reduced slice [P/N].

Reduce-scatter (sum) of the flat gradient over the shard group (N ranks), then, with hybrid sharding, an
all-reduce (sum) of the slice over the replicas: (N-1)/N·P (+ 2(R-1)/R·P/N) elements per rank. ZeRO-1/2
reduce a bucket of the data-parallel reducer this way (:class:`ZeroReduction`, a
``tessera.data_parallel.reducer.Reduction``); ZeRO-3 reduces each unit's flat parameter gradient with the
same :class:`SliceReduction` as soon as the unit's backward ends (``stage3.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.data_parallel.buckets import Bucket
from tessera.data_parallel.reducer import Reduction
from tessera.zero.shards import Shard


@dataclass
class SliceReduction:
    shard: CommGroup
    replicate: CommGroup
    dtype: torch.dtype  # the dtype gradients travel and are kept in

    def start(self, grad: torch.Tensor) -> tuple:
        """Launch the reduce-scatter of ``grad`` [P] (cast to the reduce dtype); returns the pending
        (handle, output slice [P/N], input) triple; the input stays referenced until the wait (the
        transfer reads it), then every caller drops it."""
        src = grad if grad.dtype == self.dtype else grad.to(self.dtype)
        out = torch.empty(src.numel() // self.shard.size, dtype=self.dtype, device=src.device)
        return comm.reduce_scatter(out, src, self.shard, op="sum", async_op=True), out, src

    def finish(self, pending: tuple) -> torch.Tensor:
        """Wait for the reduce-scatter, sum the slice across replicas; the reduced slice [P/N]."""
        handle, out, _ = pending
        handle.wait()
        comm.all_reduce(out, self.replicate, op="sum")
        return out


def accumulate(shard: Shard, out: torch.Tensor) -> None:
    """Add a reduced slice into ``shard.grad`` (kept where the shard's parameters live)."""
    if shard.copies is not None:  # host offload: copied to the host beside the rest of backward
        return shard.copies.add_grad(shard, out)
    out = out.to(shard.param.device, non_blocking=True)
    if shard.grad is None:
        shard.grad = out
    else:
        shard.grad.add_(out)


class ZeroReduction(Reduction):
    """ZeRO-1/2 bucket reduction: ``shard_of[bucket]`` is this rank's Shard of that gradient bucket (keyed
    by the bucket itself: the reducer launches buckets in arrival order, not in build order). Both keep
    the reduced slice in ``shard.grad`` [P/N] (reduce dtype) and drop each bucket's full gradient buffer
    [P] once its reduction is complete.

    ZeRO-1 reduces once per optimizer step: ``no_sync`` accumulates micro-batches in the full local
    gradients (``p.grad``, views into the bucket during the synchronised pass), and a second synchronised
    pass before ``zero_grad`` is an error. Its buffers are completed at the end of backward, then freed
    with every ``p.grad`` (DeepSpeed's stage 1 likewise keeps only the partition once reduced), so from
    the reduction to the next backward it holds P/N gradients, not P.
    ZeRO-2 reduces every backward into the persistent slice and frees each bucket's full gradient once
    its reduce-scatter is complete (eagerly, when the next bucket launches; see ``Reduction.eager`` for how
    many are alive at once: at most 3 in tests/test_zero_accounting.py)."""

    def __init__(self, stage: int, slices: SliceReduction, shard_of: dict[Bucket, Shard]):
        self.stage, self.slices, self.shard_of = stage, slices, shard_of
        self.keeps_views = stage == 1
        self.releases = True
        self.eager = stage == 2
        self.reduced = False  # ZeRO-1: this step's gradients were reduced already

    def begin(self) -> None:
        if self.stage == 1 and self.reduced:
            raise RuntimeError("ZeRO-1 reduces gradients once per optimizer step; accumulate "
                               "micro-batches inside no_sync() and synchronise only the last one")

    def launch(self, bucket: Bucket) -> object:
        return self.slices.start(bucket.buffer)

    def complete(self, bucket: Bucket, pending: object) -> None:
        accumulate(self.shard_of[bucket], self.slices.finish(pending))
        if self.keeps_views:  # ZeRO-1: the full gradients go with the buffer (``releases`` drops it)
            for p in bucket.params:
                p.grad = None

    def end(self) -> None:
        self.reduced = self.stage == 1
