"""Collectives over a CommGroup: skip size-1 groups, record every call, turn hangs into clear errors.

Every function takes the group as an argument and ranks as *group-local* indices (``src=0`` is the
group's first member; they are translated to global ranks, which every supported torch accepts). ``async_op=True`` returns a :class:`Handle` whose ``wait()`` finishes the call;
otherwise the call completes before returning. On a size-1 group nothing is sent: the outputs are
filled with what one process would compute and a completed handle is returned. Every call first checks
that its tensors live on the group's device (size-1 groups too), raising
:class:`~tessera.comm.group.DeviceMismatchError` otherwise.

A call that cannot complete raises a one-sentence :class:`tessera.errors.CommError` naming this rank, the
op, the axis with its member ranks and the call's sequence number on that axis, worded after the cause:
:class:`~tessera.errors.PeerGoneError` when a peer process is gone (gloo says so at once: "Connection
closed by peer"), :class:`~tessera.errors.CommTimeoutError` when the group's timeout ran out (a peer hung
or issued a different collective).
"""

from __future__ import annotations

import re
import time
from typing import Callable

import torch
import torch.distributed as dist

from tessera.comm import gloo
from tessera.comm.group import CommGroup
from tessera.comm.ledger import wire_bytes
from tessera.errors import CommError, CommTimeoutError, PeerGoneError

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def reduce_op(name: str):
    try:
        return _REDUCE_OPS[name]
    except KeyError:
        raise ValueError(f"unknown reduce op '{name}'; use one of {', '.join(_REDUCE_OPS)}") from None


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# what backends say when the other end of a connection is gone (gloo, NCCL) or when the timeout ran out
_GONE = ("closed by peer", "connection reset", "broken pipe", "connection refused", "remote process exited")
_TIMEOUT = ("timed out", "timeout")


def _backend_said(err: BaseException) -> str:
    """The backend's message without its source-file prefix, cut to its first sentence."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(err).strip())
    return text.split(". ", 1)[0].rstrip(". ")[:200]


def comm_failure(group: CommGroup, op: str, seq: int, err: BaseException, peer: int | None = None) -> CommError:
    """The one-sentence error a user sees when a call cannot complete: who, what, where, which call, and
    why. ``peer`` is the global rank of a point-to-point call's peer; in a group of two it is the other."""
    if peer is None and group.size == 2:
        peer = group.ranks[1 - group.rank]
    text = str(err).lower()
    cause = "peer gone" if any(k in text for k in _GONE) else "timeout" if any(k in text for k in _TIMEOUT) else "error"
    who = f"peer rank {peer}" if peer is not None else "a peer"
    where = f"rank {group.global_rank}: {op} call #{seq} on axis '{group.axis}' (ranks {list(group.ranks)})"
    said = _backend_said(err)
    if cause == "peer gone":
        return PeerGoneError(
            f"{where} failed because {who} is gone: its process crashed, was killed or exited "
            f"(backend said: {said})",
            rank=group.global_rank, op=op, axis=group.axis, ranks=group.ranks, peer=peer, cause=cause)
    recent = ", ".join(f"#{r.seq} {r.op}" for r in group.ledger.recent if r.axis == group.axis)
    if cause == "timeout":
        return CommTimeoutError(
            f"{where} did not complete within {group.timeout.total_seconds():g} s: {who} hung or issued a "
            f"different collective (recent calls on this axis: {recent or 'none'}; backend said: {said})",
            rank=group.global_rank, op=op, axis=group.axis, ranks=group.ranks, peer=peer, cause=cause)
    return CommError(
        f"{where} failed (recent calls on this axis: {recent or 'none'}; backend said: {said})",
        rank=group.global_rank, op=op, axis=group.axis, ranks=group.ranks, peer=peer, cause=cause)


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names now warn on every
# call); older torch lacks the new names
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """An in-flight call. ``wait()`` blocks until it is done, records the blocked time, and runs any
    finishing step (e.g. copying a gathered result into place)."""

    def __init__(self, work=None, group: CommGroup | None = None, op: str = "", seq: int = 0,
                 then: Callable[[], None] | None = None, peer: int | None = None):
        self._work, self._group, self._op, self._seq, self._then = work, group, op, seq, then
        self._peer = peer  # global rank of a point-to-point call's peer, named in its error
        self.done = work is None and then is None

    def is_completed(self) -> bool:
        """Whether the transfer has finished (without blocking); ``wait()`` is still needed to finish it."""
        return self.done or (self._work is not None and self._work.is_completed())

    def wait(self) -> None:
        if self.done:
            return
        start = time.perf_counter()
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as err:
                raise comm_failure(self._group, self._op, self._seq, err, self._peer) from err
            self._group.ledger.add_seconds(self._group.axis, self._op, time.perf_counter() - start)
        if self._then is not None:
            self._then()
        self.done = True


DONE = Handle()


def _issue(group: CommGroup, op: str, payload: int, wire: float, launch: Callable, async_op: bool,
           then: Callable[[], None] | None = None, peer: int | None = None) -> Handle:
    """Launch ``launch(async_op)`` on the group, record it, and wrap failures (``peer``: the global rank
    a point-to-point call talks to)."""
    seq = group.next_seq()
    start = time.perf_counter()
    try:
        work = launch(async_op)
    except RuntimeError as err:
        raise comm_failure(group, op, seq, err, peer) from err
    group.ledger.record(group.axis, op, payload, wire, time.perf_counter() - start, seq)
    handle = Handle(work, group, op, seq, then, peer)
    if not async_op:
        if then is not None:
            then()
        handle.done = True
    return handle


def all_reduce(tensor: torch.Tensor, group: CommGroup, op: str = "sum", async_op: bool = False) -> Handle:
    """In place: every rank ends with the reduction of all ranks' ``tensor``."""
    group.check_device("all_reduce", tensor)
    if group.size == 1:
        return DONE
    size = nbytes(tensor)
    return _issue(group, "all_reduce", size, wire_bytes("all_reduce", size, group.size),
                  lambda a: dist.all_reduce(tensor, op=reduce_op(op), group=group.pg, async_op=a), async_op)


def broadcast(tensor: torch.Tensor, group: CommGroup, src: int = 0, async_op: bool = False) -> Handle:
    """In place: every rank ends with the group-local rank ``src``'s ``tensor``."""
    group.check_device("broadcast", tensor)
    if group.size == 1:
        return DONE
    size = nbytes(tensor)
    return _issue(group, "broadcast", size, wire_bytes("broadcast", size, group.size),
                  lambda a: dist.broadcast(tensor, src=group.ranks[src], group=group.pg, async_op=a), async_op)


def reduce(tensor: torch.Tensor, group: CommGroup, dst: int = 0, op: str = "sum",
           async_op: bool = False) -> Handle:
    """The reduction lands in ``tensor`` on group-local rank ``dst`` (other ranks' tensors are scratch)."""
    group.check_device("reduce", tensor)
    if group.size == 1:
        return DONE
    size = nbytes(tensor)
    return _issue(group, "reduce", size, wire_bytes("reduce", size, group.size),
                  lambda a: dist.reduce(tensor, group.ranks[dst], op=reduce_op(op), group=group.pg, async_op=a),
                  async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: CommGroup, async_op: bool = False) -> Handle:
    """``output`` ([N·n, ...]) = the ranks' ``input`` ([n, ...]) concatenated along dim 0, in rank order."""
    group.check_device("all_gather", output, input)
    if group.size == 1:
        output.copy_(input.view_as(output))
        return DONE
    size = nbytes(output)
    wire = wire_bytes("all_gather", size, group.size)
    if gloo.gathers_by_broadcast(group, output):  # see tessera.comm.gloo
        return _issue(group, "all_gather", size, wire,
                      lambda a: gloo.all_gather_by_broadcasts(output, input, group, a), async_op)
    return _issue(group, "all_gather", size, wire,
                  lambda a: _all_gather_flat(output, input, group=group.pg, async_op=a), async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: CommGroup, op: str = "sum",
                   async_op: bool = False) -> Handle:
    """``output`` ([n, ...]) = this rank's 1/N slice (dim 0) of the reduction of every ``input`` ([N·n, ...]).

    On gloo a sum runs as a point-to-point exchange of the chunks (``tessera.comm.gloo``), other ops as
    gloo's own call. The ledger records a reduce-scatter either way."""
    group.check_device("reduce_scatter", output, input)
    if group.size == 1:
        output.copy_(input.view_as(output))
        return DONE
    size = nbytes(input)
    wire = wire_bytes("reduce_scatter", size, group.size)
    if gloo.exchanges(group, op, output, input):  # see tessera.comm.gloo
        exchange = gloo.ReduceScatterExchange(output, input, group)
        return _issue(group, "reduce_scatter", size, wire, exchange.launch, async_op, then=exchange.finish)
    return _issue(group, "reduce_scatter", size, wire,
                  lambda a: _reduce_scatter_flat(output, input, op=reduce_op(op), group=group.pg,
                                                 async_op=a), async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: CommGroup,
               output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
               async_op: bool = False) -> Handle:
    """Rank i's ``input`` rows ``input_split_sizes[j]`` go to rank j; rows from rank j land, in rank
    order, in ``output`` (``output_split_sizes[j]`` of them). No split sizes means equal splits."""
    group.check_device("all_to_all", output, input)
    if group.size == 1:
        output.copy_(input.view_as(output))
        return DONE
    row = nbytes(input) // max(input.shape[0], 1)
    splits = input_split_sizes or [input.shape[0] // group.size] * group.size
    sent = row * (sum(splits) - splits[group.rank])
    return _issue(group, "all_to_all", nbytes(input), float(sent),
                  lambda a: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                   group=group.pg, async_op=a), async_op)


def gather(tensor: torch.Tensor, group: CommGroup, dst: int = 0) -> list[torch.Tensor] | None:
    """Group-local rank ``dst`` receives every rank's ``tensor`` (a list in rank order); others get None."""
    group.check_device("gather", tensor)
    if group.size == 1:
        return [tensor.clone()]
    is_dst = group.rank == dst
    out = [torch.empty_like(tensor) for _ in range(group.size)] if is_dst else None
    piece = nbytes(tensor)
    wire = piece * (group.size - 1) if is_dst else piece
    _issue(group, "gather", piece * group.size, float(wire),
           lambda a: dist.gather(tensor, out, group.ranks[dst], group=group.pg, async_op=a), False)
    return out


def scatter(output: torch.Tensor, scatter_list: list[torch.Tensor] | None, group: CommGroup,
            src: int = 0) -> None:
    """Group-local rank ``src`` sends ``scatter_list[j]`` to rank j, which receives it into ``output``."""
    is_src = group.rank == src
    group.check_device("scatter", output, *(scatter_list if is_src and scatter_list is not None else ()))
    if group.size == 1:
        output.copy_(scatter_list[0])
        return
    piece = nbytes(output)
    wire = piece * (group.size - 1) if is_src else piece
    _issue(group, "scatter", piece * group.size, float(wire),
           lambda a: dist.scatter(output, scatter_list if is_src else None, group.ranks[src],
                                  group=group.pg, async_op=a), False)


def barrier(group: CommGroup) -> None:
    if group.size == 1:
        return
    _issue(group, "barrier", 0, 0.0, lambda a: dist.barrier(group=group.pg, async_op=a), False)
