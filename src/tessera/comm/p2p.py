"""Point-to-point messages over a CommGroup (group-local peer ranks), recorded in the ledger.

``send``/``recv`` block; ``isend``/``irecv`` return a Handle; ``batch_isend_irecv`` posts several at once
so that a pair of ranks exchanging in both directions cannot deadlock (pipeline schedules use it).
A tensor not on the group's device raises :class:`~tessera.comm.group.DeviceMismatchError` before anything
is posted. A message that cannot complete raises a :class:`tessera.errors.CommError` naming the peer's rank
(:class:`~tessera.errors.PeerGoneError` when the peer process is gone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.comm.collectives import Handle, _issue, comm_failure, nbytes
from tessera.comm.group import CommGroup


def _check_peer(group: CommGroup, peer: int, op: str) -> None:
    if group.size == 1 or not 0 <= peer < group.size or peer == group.rank:
        raise ValueError(
            f"{op} on axis '{group.axis}' needs a peer other than itself in 0..{group.size - 1}, got {peer}"
        )


def _p2p(tensor: torch.Tensor, group: CommGroup, peer: int, op: str, async_op: bool) -> Handle:
    group.check_device(op, tensor)
    _check_peer(group, peer, op)
    fn = dist.isend if op in ("send", "isend") else dist.irecv
    size = nbytes(tensor)
    name = op.lstrip("i")
    return _issue(group, name, size, float(size),
                  lambda a: _wait_unless(fn(tensor, group.ranks[peer], group=group.pg), a), async_op,
                  peer=group.ranks[peer])


def _wait_unless(work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def send(tensor: torch.Tensor, group: CommGroup, dst: int) -> None:
    _p2p(tensor, group, dst, "send", False)


def recv(tensor: torch.Tensor, group: CommGroup, src: int) -> None:
    _p2p(tensor, group, src, "recv", False)


def isend(tensor: torch.Tensor, group: CommGroup, dst: int) -> Handle:
    return _p2p(tensor, group, dst, "isend", True)


def irecv(tensor: torch.Tensor, group: CommGroup, src: int) -> Handle:
    return _p2p(tensor, group, src, "irecv", True)


@dataclass
class P2POp:
    """One message of a batch: ``op`` is "send" or "recv", ``peer`` a group-local rank."""

    op: str
    tensor: torch.Tensor
    peer: int


def batch_isend_irecv(ops: list[P2POp], group: CommGroup) -> list[Handle]:
    """Post all ``ops`` together; returns one Handle per op, in order."""
    for p in ops:
        group.check_device(p.op, p.tensor)
        _check_peer(group, p.peer, p.op)
    dist_ops = [
        dist.P2POp(dist.isend if p.op == "send" else dist.irecv, p.tensor, group.ranks[p.peer], group=group.pg)
        for p in ops
    ]
    peers = sorted({group.ranks[p.peer] for p in ops})
    try:
        works = dist.batch_isend_irecv(dist_ops)
    except RuntimeError as err:  # posting failed: name the peer when the batch has only one
        raise comm_failure(group, "batch_isend_irecv", group.seq + 1, err,
                           peers[0] if len(peers) == 1 else None) from err
    handles = []
    for p, work in zip(ops, works):
        size = nbytes(p.tensor)
        handles.append(_issue(group, p.op, size, float(size), lambda a, w=work: w, True, peer=group.ranks[p.peer]))
    return handles
