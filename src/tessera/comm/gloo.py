"""How tessera runs reduce-scatter and all-gather on gloo: the same collectives as gloo's own calls, faster.

gloo has no reduce-scatter and no in-place all-gather of its own on CPU (torch 2.13, ProcessGroupGloo):
``reduce_scatter_tensor`` all-reduces a clone of the whole input [N·n] (2(N-1)/N of it through each rank's
link, twice a reduce-scatter's bytes) and copies out the slice; ``all_gather_into_tensor`` gathers into a
fresh flat buffer [N·n] and then copies it into the output's chunks. So tessera runs:

- a sum reduce-scatter as an exchange (:class:`ReduceScatterExchange`): chunk j of the input [n] sent to
  rank j, every rank's chunk r received, all at once, and the N chunks added in rank order: (N-1)/N of the
  input through each link, nothing copied, the input only read. The sum's order is the ranks' order, the
  same for every slice (gloo's all-reduce adds in an order of its own: the two differ by rounding);
- an all-gather of at least :data:`BROADCAST_GATHER_BYTES` as N broadcasts, rank i's chunk [n] from rank i
  straight into its place in the output (below that, N calls cost more than one and gloo's call is kept).

Measured by ``python benchmarks/gloo_collectives.py`` (docs/BENCHMARKS.md, "tessera's collectives on gloo"),
the small preset's 3.03M fp32 elements on 2 shared cores, 2 and 4 ranks, three runs: the reduce-scatter in
0.33–0.47× gloo's time, the all-gather in 0.61–0.88× (medians of per-round ratios). The ledger records the collective asked for
(``tessera.comm.ledger``), whichever way it ran.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.comm.group import CommGroup

# smallest output an all-gather is run as N broadcasts for (measured: from ~1.6 MB on they are faster at
# 2, 4 and 8 ranks; for tiny tensors the N calls' fixed cost is not worth it)
BROADCAST_GATHER_BYTES = 1 << 20


class Works:
    """Several backend works in flight, finished as one (what ``Handle`` waits for)."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def gathers_by_broadcast(group: CommGroup, output: torch.Tensor) -> bool:
    """Whether :func:`all_gather_by_broadcasts` runs this all-gather."""
    return (group.backend == "gloo" and output.is_contiguous()
            and output.numel() * output.element_size() >= BROADCAST_GATHER_BYTES)


def all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group: CommGroup, async_op: bool):
    """``output`` [N·n, ...] = every rank's ``input`` [n, ...] in rank order: this rank's chunk copied in
    (nothing to copy when ``input`` is that chunk already), then chunk i broadcast from rank i, in place."""
    n = input.shape[0]
    mine = output.narrow(0, group.rank * n, n)
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.view_as(mine))
    works = Works([dist.broadcast(output.narrow(0, i * n, n), src=group.ranks[i], group=group.pg, async_op=True)
                   for i in range(group.size)])
    if not async_op:
        works.wait()
    return works


# p2p tags of reduce-scatter exchanges: above the tags other point-to-point calls use (0 by default), one
# per exchange on a group, so two in flight on one group never match each other's messages
_EXCHANGE_TAG_BASE, _EXCHANGE_TAGS = 1 << 30, 1 << 30


def exchanges(group: CommGroup, op: str, output: torch.Tensor, input: torch.Tensor) -> bool:
    """Whether a reduce-scatter runs as a :class:`ReduceScatterExchange` (gloo, a sum, contiguous tensors)."""
    return (group.backend == "gloo" and op == "sum" and output.is_contiguous() and input.is_contiguous()
            and input.numel() == group.size * output.numel())


class ReduceScatterExchange:
    """``output`` [n, ...] = the sum over ranks of chunk r (this rank's, dim 0) of every ``input`` [N·n, ...].

    :meth:`launch`: chunk j of this rank's input is sent to rank j and rank j's chunk r received, all N-1
    pairs at once; :meth:`finish` (after they complete) sums the N chunks in rank order, the same order on
    every rank, so a slice's value does not depend on which rank owns it. The first other rank's chunk is
    received straight into ``output``, the rest into N-2 buffers [n]; ``input`` is only read.
    Every rank of the group must create its exchanges in the same order (as for any collective): each
    takes the group's next exchange tag, which keeps two exchanges in flight on one group apart."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group: CommGroup):
        self.output, self.group = output, group
        n, me = output.shape[0], group.rank
        self.chunks = [input.narrow(0, j * n, n).view_as(output) for j in range(group.size)]
        self.others = [j for j in range(group.size) if j != me]
        self.into = {j: output if j == self.others[0] else torch.empty_like(output) for j in self.others}
        group.exchanges += 1
        self.tag = _EXCHANGE_TAG_BASE + group.exchanges % _EXCHANGE_TAGS

    def launch(self, async_op: bool) -> Works:
        ranks, pg = self.group.ranks, self.group.pg
        works = Works([dist.isend(self.chunks[j], ranks[j], group=pg, tag=self.tag) for j in self.others]
                      + [dist.irecv(self.into[j], ranks[j], group=pg, tag=self.tag) for j in self.others])
        if not async_op:
            works.wait()
        return works

    def finish(self) -> None:
        me = self.group.rank
        for j in range(self.group.size):  # output holds chunk others[0]: add each other chunk in rank order
            if j != self.others[0]:
                self.output.add_(self.chunks[me] if j == me else self.into[j])
