"""Run a schedule on timed stages and measure its bubble from the timeline (tests and benchmarks use it)."""

from __future__ import annotations

import torch

from tessera.comm.group import CommGroup
from tessera.pipeline.executor import PipelineExecutor
from tessera.pipeline.schedules import Action, build_schedule
from tessera.pipeline.synthetic import TimedStage
from tessera.timeline import Timeline, bubble_fraction, gather


def measure_bubble(pp: CommGroup, schedule: str, m: int, v: int = 1, forward_s: float = 0.02,
                   dim: int = 8, steps: int = 3) -> dict:
    """One rank's part: ``steps`` steps of ``schedule`` on TimedStage stages whose forward takes
    ``forward_s`` and whose backward twice that (split half/half into B and W when the schedule splits
    it); a rank's total work is the same for every v. After one warm-up step, runs ``steps`` measured
    steps and keeps the one with the smallest bubble (a shared machine only ever adds delay, so the least
    disturbed step is the best estimate of the schedule's own bubble). Returns that step's gathered events,
    bubble, per-rank bubbles and this rank's peak live activations."""
    sched = build_schedule(schedule, pp.size, m, v)
    f = forward_s / v
    b, w = (f, f) if sched.split_backward else (2 * f, 0.0)
    stages = {s: TimedStage(dim, f, b, w) for s in sched.stages_of(pp.rank)}
    timeline = Timeline(pp.rank)
    ex = PipelineExecutor(stages, sched, pp, lambda out, y: (out * y).sum(), lambda x: x.shape,
                          timeline=timeline)
    g = torch.Generator().manual_seed(0)
    micro = [(torch.randn(2, dim, generator=g), torch.randn(2, dim, generator=g))
             for _ in range(sched.n_microbatches)]
    ex.step(micro)  # warm-up
    best = None
    for _ in range(steps):
        timeline.clear()
        out = ex.step(micro)
        events = gather(timeline, pp)  # every rank gets every event: all agree on the best step
        bubble, per_rank = bubble_fraction(events, pp.size)
        if best is None or bubble < best["bubble"]:
            best = {"events": events, "bubble": bubble, "per_rank": per_rank, "peak": out.peak_activations}
    return best


# ---- steps without a flush (pipeline.flush = false) -----------------------------------------------------

def boundary_idle(intervals: list[list[tuple[Action, float, float]]], m: int, steps: int) -> list[list[float]]:
    """idle[r][t]: the time rank r is idle between the end of its last forward of step t and the start of
    its first backward of step t+1 (t < steps-1) — the slots a flush drains and refills. ``intervals``: per
    rank, (compute action with the global micro-batch number t*m + i, start, end), from the checker's
    simulation or a measured timeline (:func:`measure_steps`)."""
    out = []
    for acts in intervals:
        row = []
        for t in range(steps - 1):
            lo = max(e for a, _, e in acts if a.kind == "F" and a.mb // m == t)
            hi = min(s for a, s, _ in acts if a.kind == "B" and a.mb // m == t + 1)
            busy = sum(max(0.0, min(e, hi) - max(s, lo)) for _, s, e in acts)
            row.append(max(0.0, hi - lo - busy))
        out.append(row)
    return out


def measure_steps(pp: CommGroup, schedule: str, m: int, steps: int, flush: bool, forward_s: float = 0.02,
                  dim: int = 8) -> dict:
    """One rank's part: ``steps`` consecutive steps of ``schedule`` (pipedream or 2bw) on TimedStage stages
    (forward ``forward_s``, backward twice that), with a flush after every step or, with ``flush=False``,
    each step handed the next one's micro-batches (only the last drains). Returns, on every rank, the
    bubble over the whole run, per-rank boundary idle times (:func:`boundary_idle`) and the gathered events
    (named with global micro-batch numbers)."""
    sched = build_schedule(schedule, pp.size, m)
    stages = {s: TimedStage(dim, forward_s, 2 * forward_s, 0.0) for s in sched.stages_of(pp.rank)}
    timeline = Timeline(pp.rank)
    ex = PipelineExecutor(stages, sched, pp, lambda out, y: (out * y).sum(), lambda x: x.shape,
                          timeline=timeline, flush=flush)
    g = torch.Generator().manual_seed(0)
    batches = [[(torch.randn(2, dim, generator=g), torch.randn(2, dim, generator=g)) for _ in range(m)]
               for _ in range(steps)]
    local = Timeline(pp.rank)
    for t in range(steps):
        timeline.clear()
        ex.step(batches[t], None if flush or t == steps - 1 else batches[t + 1])
        for e in timeline.events:  # "F0.5" of step t is global micro-batch t*m + 5
            kind, rest = e.name[0], e.name[1:]
            if e.cat == "compute" and kind in "FB" and "." in rest:
                stage, mb = rest.split(".")
                local.add(f"{kind}{stage}.{t * m + int(mb)}", e.cat, e.start, e.end)
    events = gather(local, pp)
    bubble, per_rank = bubble_fraction(events, pp.size)
    intervals = [[(Action(e.name[0], int(e.name[1:].split(".")[0]), int(e.name.split(".")[1])), e.start, e.end)
                  for e in events if e.rank == r] for r in range(pp.size)]
    return {"bubble": bubble, "per_rank": per_rank, "idle": boundary_idle(intervals, m, steps), "events": events}
