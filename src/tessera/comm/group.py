"""CommGroup: a process group as a value — its axis name, member ranks, device, ledger and timeout.

Strategies receive CommGroups as arguments (never read them from a global). A size-1 group carries no
process group at all (``pg is None``); every collective on it is skipped by ``tessera.comm``.

``device`` is where every tensor handed to the group's collectives must live: the rank's accelerator for
NCCL, the CPU for gloo (``tessera.topology`` derives it when it builds the groups). ``tessera.comm``
checks it on every call, size-1 groups included, so a tensor left on the host fails on a one-process CPU
run with one sentence instead of deep inside NCCL on a GPU job.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.comm.ledger import CommLedger
from tessera.errors import CommError


class DeviceMismatchError(CommError):
    """A tensor handed to a collective or point-to-point call does not live on its group's device (a bug
    in the caller: on a GPU job the backend would reject it, or copy it silently)."""


def _indexed(device: torch.device) -> torch.device:
    """An accelerator named without an index means the current one (tensors always carry their index)."""
    if device.index is None and device.type not in ("cpu", "meta"):
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


class CommGroup:
    def __init__(
        self,
        axis: str,
        pg,
        ranks: tuple[int, ...],
        global_rank: int,
        ledger: CommLedger | None = None,
        timeout: timedelta = timedelta(minutes=5),
        device: torch.device | str = "cpu",
    ):
        self.axis = axis
        self.pg = pg
        self.ranks = tuple(int(r) for r in ranks)
        self.global_rank = int(global_rank)
        self.rank = self.ranks.index(self.global_rank)  # local rank in this group
        self.size = len(self.ranks)
        self.ledger = ledger if ledger is not None else CommLedger()
        self.timeout = timeout
        self.device = _indexed(torch.device(device))
        self.seq = 0  # calls issued on this group; named in timeout errors
        self.exchanges = 0  # reduce-scatters run as point-to-point exchanges (tessera.comm.gloo): their tags

    @classmethod
    def single(cls, axis: str = "world", ledger: CommLedger | None = None,
               device: torch.device | str = "cpu") -> CommGroup:
        """The trivial group of one process: every collective is a no-op (the device is still checked)."""
        return cls(axis, None, (0,), 0, ledger, device=device)

    def check_device(self, op: str, *tensors: torch.Tensor | None) -> None:
        """Raise :class:`DeviceMismatchError` (one sentence) unless every tensor lives on ``self.device``;
        one device comparison per tensor (``None`` entries, e.g. a non-root's scatter list, are skipped)."""
        for t in tensors:
            if t is not None and t.device != self.device:
                raise DeviceMismatchError(
                    f"rank {self.global_rank}: {op} on axis '{self.axis}' (ranks {list(self.ranks)}) was handed "
                    f"a tensor on {t.device} but the group's device is {self.device}; every tensor of a "
                    f"collective must live on its group's device",
                    rank=self.global_rank, op=op, axis=self.axis, ranks=self.ranks, cause="device")

    @functools.cached_property
    def backend(self) -> str | None:
        """The name of the backend that carries this group's tensors ("gloo", "nccl", ...; None without a
        process group). A process group with one backend per device type ("cpu:gloo,cuda:nccl") answers for
        the group's device."""
        if self.pg is None:
            return None
        name = str(dist.get_backend(self.pg))
        if ":" not in name:
            return name
        per_device = dict(part.split(":", 1) for part in name.split(","))
        return per_device.get(self.device.type)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def __repr__(self) -> str:
        return (f"CommGroup(axis={self.axis!r}, rank={self.rank}/{self.size}, ranks={list(self.ranks)}, "
                f"device={str(self.device)!r})")
