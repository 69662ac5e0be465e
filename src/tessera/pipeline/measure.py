"""Run a schedule on timed stages and measure its bubble from the timeline (tests and benchmarks use it)."""

from __future__ import annotations

import torch

from tessera.comm.group import CommGroup
from tessera.pipeline.executor import PipelineExecutor
from tessera.pipeline.schedules import build_schedule
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
