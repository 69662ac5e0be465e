"""Every collective a strategy issues goes through here: tensors checked against the group's device,
size-1 groups skipped, calls recorded in a CommLedger, hangs turned into errors that name the rank, op,
axis and call number."""

from tessera.comm.autograd import copy_to, gather_from, reduce_from, scatter_to
from tessera.comm.collectives import (
    Handle,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from tessera.comm.group import CommGroup, DeviceMismatchError
from tessera.comm.ledger import CommLedger, CommStat, wire_bytes
from tessera.comm.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send

__all__ = [
    "CommGroup", "CommLedger", "DeviceMismatchError", "CommStat", "Handle", "P2POp", "wire_bytes",
    "all_gather", "all_reduce", "all_to_all", "barrier", "batch_isend_irecv", "broadcast", "gather",
    "irecv", "isend", "recv", "reduce", "reduce_scatter", "scatter", "send",
    "copy_to", "gather_from", "reduce_from", "scatter_to",
]
