"""CommLedger: every collective a process issues, counted by (axis, op).

For each call we keep the payload ``bytes`` (the size of the tensor the caller handed in; for the
gathering and scattering ops the full, unsharded size) and the ``wire_bytes``: the traffic through this
rank's link in one direction under the bandwidth-optimal algorithm (ring for the collectives, direct for
point-to-point), i.e. what NCCL-tests calls bus bytes. With N ranks and a payload of S bytes:

    all_reduce      2(N-1)/N · S        reduce_scatter, all_gather   (N-1)/N · S (S = full size)
    broadcast, reduce       S           all_to_all     bytes sent to the other ranks
    gather / scatter  root (N-1)·s, others s (s = one rank's piece)   send / recv     S

These are the bytes of the collective asked for under that algorithm, not of whatever a backend runs:
gloo's own reduce-scatter on CPU, for one, is an all-reduce and moves 2(N-1)/N · S (tessera's, an exchange
of the chunks, moves exactly (N-1)/N · S: ``tessera.comm.gloo``).

``seconds`` is the time the caller was blocked: the whole call when synchronous, the launch plus the
``wait()`` when asynchronous (communication overlapped with compute is, rightly, not counted).
"""

from __future__ import annotations

import collections
import copy
from dataclasses import asdict, dataclass


@dataclass
class CommStat:
    count: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0
    seconds: float = 0.0

    def add(self, other: CommStat) -> None:
        self.count += other.count
        self.bytes += other.bytes
        self.wire_bytes += other.wire_bytes
        self.seconds += other.seconds


@dataclass(frozen=True)
class CallRecord:
    seq: int
    axis: str
    op: str
    bytes: int


def wire_bytes(op: str, nbytes: int, world: int) -> float:
    """Per-rank link traffic of a collective of ``nbytes`` payload over ``world`` ranks (see module doc)."""
    if world <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (world - 1) / world * nbytes
    if op in ("reduce_scatter", "all_gather"):
        return (world - 1) / world * nbytes
    return float(nbytes)


class CommLedger:
    """Per-process record of communication. Cheap enough to stay on in production runs."""

    def __init__(self, history: int = 32):
        self._stats: dict[tuple[str, str], CommStat] = collections.defaultdict(CommStat)
        self.recent: collections.deque[CallRecord] = collections.deque(maxlen=history)

    def record(self, axis: str, op: str, nbytes: int, wire: float, seconds: float, seq: int = -1) -> None:
        stat = self._stats[(axis, op)]
        stat.count += 1
        stat.bytes += int(nbytes)
        stat.wire_bytes += float(wire)
        stat.seconds += float(seconds)
        self.recent.append(CallRecord(seq, axis, op, int(nbytes)))

    def add_seconds(self, axis: str, op: str, seconds: float) -> None:
        """Blocked time discovered later (an async handle's ``wait``)."""
        self._stats[(axis, op)].seconds += float(seconds)

    def stats(self) -> dict[tuple[str, str], CommStat]:
        return {k: copy.copy(v) for k, v in self._stats.items()}

    def total(self, axis: str | None = None, op: str | None = None) -> CommStat:
        out = CommStat()
        for (a, o), stat in self._stats.items():
            if (axis is None or a == axis) and (op is None or o == op):
                out.add(stat)
        return out

    def since(self, earlier: dict[tuple[str, str], CommStat]) -> dict[tuple[str, str], CommStat]:
        """The difference between now and an earlier ``stats()`` snapshot (keys with no calls dropped)."""
        out = {}
        for key, stat in self._stats.items():
            before = earlier.get(key, CommStat())
            diff = CommStat(
                stat.count - before.count,
                stat.bytes - before.bytes,
                stat.wire_bytes - before.wire_bytes,
                stat.seconds - before.seconds,
            )
            if diff.count:
                out[key] = diff
        return out

    def reset(self) -> None:
        self._stats.clear()
        self.recent.clear()

    @staticmethod
    def as_dict(stats: dict[tuple[str, str], CommStat]) -> dict[str, dict]:
        """JSON-friendly form: ``{"axis/op": {"count", "bytes", "wire_bytes", "seconds"}}``."""
        return {f"{a}/{o}": asdict(s) for (a, o), s in sorted(stats.items())}

    def table(self) -> str:
        rows = [f"{'axis':<14}{'op':<16}{'count':>8}{'MiB':>12}{'wire MiB':>12}{'seconds':>10}"]
        for (axis, op), s in sorted(self._stats.items()):
            rows.append(
                f"{axis:<14}{op:<16}{s.count:>8}{s.bytes / 2**20:>12.3f}"
                f"{s.wire_bytes / 2**20:>12.3f}{s.seconds:>10.3f}"
            )
        return "\n".join(rows)
