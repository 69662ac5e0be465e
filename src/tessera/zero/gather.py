"""ZeRO-1/2's parameter all-gather after the step, in buckets of their own size (``zero.allgather_bucket_mb``).

Rank r owns slice r [n_b] of every reduce bucket b, whose flat parameters are ``flat_b`` [N·n_b]. Lay this
rank's slices of all buckets end to end: a stream of Σ n_b elements. An all-gather bucket takes the next k
elements of that stream from every rank, k = cap / (N · element size) (at least 1): it is a list of pieces
(bucket b, slice range [a, e)), and there are ceil(Σ n_b / k) all-gathers per step, whatever the reduce
buckets are. Without a cap (``zero.allgather_bucket_mb`` = 0) the all-gather buckets are the reduce buckets,
one all-gather each.

A call that is exactly one reduce bucket's whole slice gathers straight into ``flat_b`` (in place). Any other call
gathers into a staging buffer [N, k] whose row r is rank r's pieces, copied out piece by piece into the
columns [a, e) of ``flat_b`` viewed as [N, n_b]; at most two staged calls are in flight, so staging holds
at most 2·cap bytes. The values are the owners' slices either way: the sizes never change results.
"""

from __future__ import annotations

import torch

from tessera import comm
from tessera.comm.group import CommGroup

Piece = tuple[int, int, int]  # (reduce bucket index, start, end) inside this rank's slice of that bucket


def plan_gathers(slice_sizes: list[int], per_rank: int | None) -> list[list[Piece]]:
    """The all-gather buckets over slices of ``slice_sizes`` elements: at most ``per_rank`` elements of
    each rank per call (None: one call per reduce bucket)."""
    if per_rank is None:
        return [[(i, 0, n)] for i, n in enumerate(slice_sizes)]
    calls, current, room = [], [], per_rank
    for i, n in enumerate(slice_sizes):
        a = 0
        while a < n:
            take = min(room, n - a)
            current.append((i, a, a + take))
            a, room = a + take, room - take
            if room == 0:
                calls.append(current)
                current, room = [], per_rank
    if current:
        calls.append(current)
    return calls


class ParamGather:
    """All-gathers ``flats`` [N·n_b] from this rank's ``slices`` [n_b] (views into them) over ``group`` in
    buckets of at most ``cap_bytes`` gathered bytes each (None: one per flat)."""

    def __init__(self, flats: list[torch.Tensor], slices: list[torch.Tensor], group: CommGroup,
                 cap_bytes: int | None):
        self.flats, self.slices, self.group = flats, slices, group
        per_rank = None
        if cap_bytes is not None and flats:
            per_rank = max(1, int(cap_bytes) // (group.size * flats[0].element_size()))
        self.calls = plan_gathers([s.numel() for s in slices], per_rank)

    @torch.no_grad()
    def run(self) -> None:
        pending = []
        for call in self.calls:
            while sum(staged is not None for _, staged, _ in pending) >= 2:
                self._finish(*pending.pop(0))
            pending.append(self._launch(call))
        for p in pending:
            self._finish(*p)

    def _launch(self, call: list[Piece]) -> tuple:
        i, a, e = call[0]
        if len(call) == 1 and a == 0 and e == self.slices[i].numel():  # a whole bucket: straight in place
            # in place: the input is the output's chunk r, which every backend fills with rank r's input
            # (NCCL's in-place all-gather; gloo gathers into a buffer of its own and copies out), so no copy
            return comm.all_gather(self.flats[i], self.slices[i], self.group, async_op=True), None, call
        pieces = [self.slices[i][a:e] for i, a, e in call]
        source = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        staged = torch.empty(self.group.size * source.numel(), dtype=source.dtype, device=source.device)
        return comm.all_gather(staged, source, self.group, async_op=True), staged, call

    def _finish(self, handle, staged: torch.Tensor | None, call: list[Piece]) -> None:
        handle.wait()
        if staged is None:
            return
        rows = staged.view(self.group.size, -1)  # [N, k]: row r is rank r's pieces
        c = 0
        for i, a, e in call:
            self.flats[i].view(self.group.size, -1)[:, a:e].copy_(rows[:, c : c + e - a])
            c += e - a
