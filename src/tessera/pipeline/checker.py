"""Prove a schedule safe before launch, and the bubble it implies for given action times.

The simulation follows the executor's semantics: a SEND posts its message and returns (the executor uses
isend and waits on it only at the end of the step); a RECV blocks until the next message on that
(sender, receiver) pair arrives, and that message must be the one it expects (point-to-point messages
between two ranks are matched in order). Compute actions need their inputs on this rank: a forward needs
the activation received (or the previous stage's forward done here), a backward its own forward and the
output gradient, a weight-gradient its backward. If no rank can advance while some still have actions,
the schedule deadlocks, and the report names the first stuck action.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tessera.pipeline.schedules import COMPUTE, Action, Schedule


class ScheduleError(ValueError):
    """A schedule that cannot run: a deadlock, a message nobody receives, or a missing dependency."""


@dataclass
class CheckReport:
    makespan: float  # time from the first action to the last, all ranks
    busy: list[float]  # compute time per rank
    bubble: float  # idle fraction: 1 - sum(busy) / (pp * makespan)
    peak_activations: list[int]  # most micro-batches whose forward output is held at once, per rank
    intervals: list[list[tuple[Action, float, float]]] = field(default_factory=list)  # (action, start, end)


def default_times(schedule: Schedule) -> Callable[[Action], float]:
    """Unit forward; backward twice a forward (input + weight gradient, each one unit when split)."""
    def t(a: Action) -> float:
        if a.kind == "F" or a.kind == "W":
            return 1.0
        if a.kind == "B":
            return 1.0 if schedule.split_backward else 2.0
        return 0.0
    return t


def check(schedule: Schedule, times: Callable[[Action], float] | None = None,
          comm_time: float = 0.0) -> CheckReport:
    """Simulate ``schedule``; raise ScheduleError naming the first problem, else return the report."""
    if len(schedule.actions) != schedule.pp:
        raise ScheduleError(f"schedule has action lists for {len(schedule.actions)} ranks but pp={schedule.pp}")
    sim = _Simulation(schedule, times or default_times(schedule), comm_time)
    sim.run_to_end()
    for (src, dst), q in sim.channels.items():
        if q:
            raise ScheduleError(f"rank {src}'s {q[0][0]} has no matching receive on rank {dst}")
    makespan = max(sim.clock) if sim.clock else 0.0
    bubble = 1.0 - sum(sim.busy) / (schedule.pp * makespan) if makespan > 0 else 0.0
    return CheckReport(makespan, sim.busy, bubble, sim.peak, sim.intervals)


class _Simulation:
    """Every rank's program counter and clock; messages in flight per (sender, receiver) pair."""

    def __init__(self, schedule: Schedule, times: Callable[[Action], float], comm_time: float):
        pp = schedule.pp
        self.schedule, self.times, self.comm_time = schedule, times, comm_time
        self.acts = schedule.actions
        self.pc, self.clock, self.busy = [0] * pp, [0.0] * pp, [0.0] * pp
        self.live, self.peak = [0] * pp, [0] * pp
        self.channels: dict[tuple[int, int], deque] = {}
        self.done: list[set] = [set() for _ in range(pp)]  # (kind, stage, mb) completed or received here
        self.intervals: list[list] = [[] for _ in range(pp)]

    def run_to_end(self) -> None:
        pp, acts, pc = self.schedule.pp, self.acts, self.pc
        while any(pc[r] < len(acts[r]) for r in range(pp)):
            progressed = False
            for r in range(pp):
                while pc[r] < len(acts[r]) and self.blocked_on(r, acts[r][pc[r]]) is None:
                    self.run(r, acts[r][pc[r]])
                    pc[r] += 1
                    progressed = True
            if not progressed:
                self._deadlock()

    def _deadlock(self) -> None:
        stuck = [(r, self.acts[r][self.pc[r]]) for r in range(self.schedule.pp) if self.pc[r] < len(self.acts[r])]
        r0, a0 = stuck[0]
        others = "; ".join(f"rank {r} at {a}" for r, a in stuck[1:])
        raise ScheduleError(
            f"deadlock: the first stuck action is rank {r0}'s {a0} (action #{self.pc[r0]}), which "
            f"{self.blocked_on(r0, a0)} that is never sent" + (f"; also stuck: {others}" if others else "")
        )

    def blocked_on(self, r: int, a: Action) -> str | None:
        """None if action ``a`` of rank ``r`` can run now; else why not (a receive with nothing to read)."""
        if a.kind.startswith("RECV"):
            q = self.channels.get((a.peer, r))
            if not q:
                return f"waits for a message from rank {a.peer}"
            sent, _ = q[0]
            want = ("SEND_F", a.stage - 1) if a.kind == "RECV_F" else ("SEND_B", a.stage + 1)
            if (sent.kind, sent.stage, sent.mb) != (*want, a.mb):
                raise ScheduleError(f"rank {r}: {a} would receive {sent} from rank {a.peer}: messages out of order")
        return None

    def run(self, r: int, a: Action) -> None:
        start, done = self.clock[r], self.done[r]
        if a.kind.startswith("SEND"):
            if a.kind == "SEND_F" and ("F", a.stage, a.mb) not in done:
                raise ScheduleError(f"rank {r}: {a} sends an activation its forward has not produced yet")
            if a.kind == "SEND_B" and ("B", a.stage, a.mb) not in done:
                raise ScheduleError(f"rank {r}: {a} sends a gradient its backward has not produced yet")
            self.channels.setdefault((r, a.peer), deque()).append((a, start + self.comm_time))
        elif a.kind.startswith("RECV"):
            _, arrival = self.channels[(a.peer, r)].popleft()
            self.clock[r] = max(self.clock[r], arrival)
            done.add((a.kind, a.stage, a.mb))
        elif a.kind in COMPUTE:
            self._compute(r, a, start)
        done.add((a.kind, a.stage, a.mb))

    def _compute(self, r: int, a: Action, start: float) -> None:
        _check_dependencies(self.schedule, r, a, self.done[r])
        self.clock[r] += self.times(a)
        self.busy[r] += self.times(a)
        self.intervals[r].append((a, start, self.clock[r]))
        if a.kind == "F":
            self.live[r] += 1
            self.peak[r] = max(self.peak[r], self.live[r])
        if a.kind == "B":
            self.live[r] -= 1


def _check_dependencies(schedule: Schedule, r: int, a: Action, done: set) -> None:
    """A compute action's inputs must already be on this rank (a wrong order is an error, not a wait)."""
    last = schedule.n_stages - 1
    if a.kind == "F" and a.stage > 0:
        have = ("RECV_F", a.stage, a.mb) in done or ("F", a.stage - 1, a.mb) in done
        if not have:
            raise ScheduleError(f"rank {r}: {a} runs before its input activation is on this rank")
    elif a.kind == "B":
        if ("F", a.stage, a.mb) not in done:
            raise ScheduleError(f"rank {r}: {a} runs before its forward")
        if a.stage < last and not (("RECV_B", a.stage, a.mb) in done or ("B", a.stage + 1, a.mb) in done):
            raise ScheduleError(f"rank {r}: {a} runs before its output gradient is on this rank")
    elif a.kind == "W" and ("B", a.stage, a.mb) not in done:
        raise ScheduleError(f"rank {r}: {a} runs before its backward")


def verify_complete(schedule: Schedule) -> None:
    """Every stage runs F and B (and W when split) exactly once per micro-batch on its own rank."""
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    for r in range(schedule.pp):
        seen = [(a.kind, a.stage, a.mb) for a in schedule.compute(r)]
        want = sorted((k, s, i) for k in kinds for s in schedule.stages_of(r)
                      for i in range(schedule.n_microbatches))
        if sorted(seen) != want:
            missing = sorted(set(want) - set(seen))
            extra = sorted(set(seen) - set(want)) or [x for x in seen if seen.count(x) > 1][:1]
            raise ScheduleError(f"rank {r}: compute actions incomplete (missing {missing[:3]}, extra {extra[:3]})")
