"""The one gradient-reduction mechanism of data parallelism: buckets, hooks, in-order launch, no_sync.

A :class:`GradReducer` reduces the gradients of a set of parameters, laid into buckets
(``tessera.data_parallel.buckets``), over data-parallel ranks. DDP, ZeRO-1/2, expert data parallelism and
the pipeline's dp reduction all use it; only the :class:`Reduction` (what one full bucket's collective is
and what is kept of it) differs: an all-reduce for DDP, a reduce-scatter (+ all-reduce across replicas)
for ZeRO.

Hook mode: a post-accumulate-grad hook on every parameter moves its fresh gradient into its bucket slot;
the moment a bucket is full its reduction is launched asynchronously, strictly in one fixed bucket order
on every rank ("reduce order kept") whatever order the hooks fire in, so the collectives match across
ranks while backward goes on. The first hook of a pass queues an end-of-backward callback, which *adopts* every
slot no hook filled (a gradient accumulated earlier under ``no_sync``, or zeros for a parameter this pass
did not reach, so no bucket waits forever and no rank hangs), launches the remaining buckets in order and
completes every reduction. Manual mode (no hooks): :meth:`reduce_gradients` does that same end-of-pass
work after any number of backwards (a pipeline schedule's micro-batches). Inside :meth:`no_sync` the hooks
do nothing, so gradients accumulate in ``p.grad`` and the next reduction takes their sum once.

With ``find_unused`` one more small all-reduce counts, per parameter, the ranks that hold a gradient for
it; a parameter no rank holds one for gets ``grad = None`` back, exactly as in a single process.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.data_parallel.buckets import Bucket


class Reduction:
    """What one full bucket's reduction is. Subclasses implement :meth:`launch` and :meth:`complete`.

    ``keeps_views``: after a pass ``p.grad`` is the parameter's slot in its bucket (else None: ZeRO-2,
    whose full gradients are gone once reduced). Only then can ``no_sync()`` put the reduction off to a
    later pass (the gradients accumulate in the slots); otherwise every backward reduces.
    ``releases``: drop a bucket's buffer once its reduction is complete (the next pass makes a new one).
    ``eager``: complete bucket k-1 as soon as bucket k is launched (k-1 had k's backward to overlap
    with), so a bucket's full buffer lives from its first gradient to the next launch; how many are
    alive at once depends on how far apart backward fills them (a bucket of parameters spread over the
    whole model, such as the norm weights' param group, lives through most of backward).
    """

    keeps_views: bool = True
    releases: bool = False
    eager: bool = False
    scale: float | None = None  # gradients are multiplied by this as they enter their slots (None: not)

    def begin(self) -> None:
        """A pass starts (its first gradient arrived, or a manual reduction was asked for)."""

    def launch(self, bucket: Bucket) -> object:
        """Start reducing ``bucket.buffer`` asynchronously; returns what :meth:`complete` needs."""
        raise NotImplementedError

    def complete(self, bucket: Bucket, pending: object) -> None:
        """Wait for the bucket's reduction and keep its result."""
        raise NotImplementedError

    def end(self) -> None:
        """Every bucket of the pass is reduced."""


class AllReduce(Reduction):
    """DDP: each bucket all-reduced (sum) in place over ``group``. "avg" divides by the group size on the
    way into the bucket (each gradient is written to its slot as grad × 1/N, one pass, as torch's DDP
    does), not after the reduction: a backend's average is a second pass over every bucket, at the end of
    backward where nothing hides it. "sum" leaves the gradients summed, for losses already divided by the
    global token count. 2(N-1)/N × bucket bytes per rank."""

    def __init__(self, group: CommGroup, op: str = "avg", releases: bool = False):
        if op not in ("avg", "sum"):
            raise ValueError(f"reduce_op must be 'avg' or 'sum', got '{op}'")
        self.group, self.releases = group, releases
        self.scale = 1.0 / group.size if op == "avg" and group.size > 1 else None

    def launch(self, bucket: Bucket) -> object:
        return comm.all_reduce(bucket.buffer, self.group, op="sum", async_op=True)

    def complete(self, bucket: Bucket, pending: object) -> None:
        pending.wait()


class GradReducer:
    """Reduces the gradients of the parameters in ``buckets`` by ``reduction`` (see the module docstring);
    the list order of ``buckets`` is their launch order (the same on every rank).

    ``hooks``: launch from gradient hooks during backward (False: only :meth:`reduce_gradients`).
    ``find_unused``: give ``grad = None`` back to parameters no rank of ``group`` holds a gradient for.
    """

    def __init__(self, buckets: list[Bucket], reduction: Reduction, hooks: bool = True,
                 find_unused: bool = False, group: CommGroup | None = None):
        if find_unused and (group is None or not reduction.keeps_views):
            raise ValueError("find_unused needs the reduction's group and gradients kept as bucket views")
        self.buckets, self.reduction = buckets, reduction
        self.find_unused, self.group = find_unused, group
        self._slot = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._sync, self._queued, self._in_finish, self._next = True, False, False, 0
        # buckets whose reduction started from a gradient hook, i.e. overlapped with the rest of the
        # last backward (the others started at its end): a measure of achieved overlap
        self.early_launches = 0
        if hooks:
            for b in buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first reduction after the block takes the total."""
        if not self.reduction.keeps_views:
            yield
            return
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def reduce_gradients(self) -> None:
        """Manual mode: reduce the gradients that backwards the hooks did not see have left in ``p.grad``
        (the same collectives as a synchronised backward's)."""
        self._begin()
        self._finish()

    # ---- hook mode -----------------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._queued:
            self._begin()  # may refuse the pass (ZeRO-1 reduces once per step): nothing is queued then
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket, i = self._slot[id(p)]
        if i in bucket.filled:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} received a second gradient in one backward pass; "
                "data parallelism reduces each gradient once per pass (run the pieces in one backward)"
            )
        self._take(bucket, i, p)
        self._launch_ready()

    def _begin(self) -> None:
        self.early_launches = 0
        self.reduction.begin()

    def _take(self, bucket: Bucket, i: int, p: nn.Parameter) -> None:
        """Write p's gradient (zeros if it has none) into its slot, times the reduction's ``scale``;
        ``p.grad`` becomes the slot, or None. (Plain tensor ops on gradients, which autograd does not
        record: no ``no_grad`` needed here.)"""
        bucket.filled.add(i)
        bucket.allocate()
        view, scale = bucket.view(i), self.reduction.scale
        if p.grad is None:
            view.zero_()
            bucket.empty.add(i)
        elif p.grad.data_ptr() == view.data_ptr():  # accumulated straight into its slot: nothing to move
            if scale is not None:
                view.mul_(scale)
            return
        elif scale is not None:
            torch.mul(p.grad, scale, out=view)
        else:
            view.copy_(p.grad)
        p.grad = view if self.reduction.keeps_views else None

    def _launch_ready(self) -> None:
        """Launch buckets in list order only: bucket k waits for buckets < k, on every rank alike."""
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            bucket = self.buckets[self._next]
            if not self._in_finish:
                self.early_launches += 1
            bucket.pending = self.reduction.launch(bucket)
            if self.reduction.eager and self._next > 0:
                self._complete(self.buckets[self._next - 1])
            self._next += 1

    def _complete(self, bucket: Bucket) -> None:
        if bucket.pending is None:
            return
        pending, bucket.pending = bucket.pending, None
        self.reduction.complete(bucket, pending)
        if self.reduction.releases:
            bucket.buffer = None

    # ---- end of a pass -------------------------------------------------------------------------
    @torch.no_grad()
    def _finish(self) -> None:
        """Adopt every slot no hook filled, launch the remaining buckets in order, complete them all,
        then (``find_unused``) give ``grad = None`` back to parameters no rank has a gradient for."""
        self._in_finish = True
        try:
            for bucket in self.buckets[self._next :]:
                for i, p in enumerate(bucket.params):
                    if i not in bucket.filled:
                        self._take(bucket, i, p)
            self._launch_ready()
            counts = self._count_holders() if self.find_unused and self.buckets else None
            for bucket in self.buckets:
                self._complete(bucket)
            if counts is not None:
                self._drop_unused(counts.tolist())
            self.reduction.end()
        finally:
            for bucket in self.buckets:
                bucket.filled.clear()
                bucket.empty.clear()
            self._next, self._queued, self._in_finish = 0, False, False

    def _count_holders(self) -> torch.Tensor:
        """How many ranks hold a gradient for each parameter (one small all-reduce, after the buckets)."""
        held = [float(i not in b.empty) for b in self.buckets for i in range(len(b.params))]
        counts = torch.tensor(held, dtype=torch.float32, device=self.buckets[0].params[0].device)
        comm.all_reduce(counts, self.group)
        return counts

    def _drop_unused(self, holders: list[float]) -> None:
        k = 0
        for bucket in self.buckets:
            for p in bucket.params:
                if holders[k] == 0:
                    p.grad = None
                k += 1
