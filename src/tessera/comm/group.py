"""CommGroup: a process group as a value — its axis name, member ranks, ledger and timeout.

Strategies receive CommGroups as arguments (never read them from a global). A size-1 group carries no
process group at all (``pg is None``); every collective on it is skipped by ``tessera.comm``.
"""

from __future__ import annotations

from datetime import timedelta

from tessera.comm.ledger import CommLedger


class CommGroup:
    def __init__(
        self,
        axis: str,
        pg,
        ranks: tuple[int, ...],
        global_rank: int,
        ledger: CommLedger | None = None,
        timeout: timedelta = timedelta(minutes=5),
    ):
        self.axis = axis
        self.pg = pg
        self.ranks = tuple(int(r) for r in ranks)
        self.global_rank = int(global_rank)
        self.rank = self.ranks.index(self.global_rank)  # local rank in this group
        self.size = len(self.ranks)
        self.ledger = ledger if ledger is not None else CommLedger()
        self.timeout = timeout
        self.seq = 0  # calls issued on this group; named in timeout errors

    @classmethod
    def single(cls, axis: str = "world", ledger: CommLedger | None = None) -> CommGroup:
        """The trivial group of one process: every collective is a no-op."""
        return cls(axis, None, (0,), 0, ledger)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def __repr__(self) -> str:
        return f"CommGroup(axis={self.axis!r}, rank={self.rank}/{self.size}, ranks={list(self.ranks)})"
