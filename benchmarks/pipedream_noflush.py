"""PipeDream / 2BW with and without a flush between optimizer steps: the bubble over a run and the idle
time at step boundaries, measured on sleeping stages (TimedStage), beside the unit-time theory.

    python benchmarks/pipedream_noflush.py            # p = 4, m = 4 and 8, 8 steps; writes docs/PIPELINE.md
    python benchmarks/pipedream_noflush.py --no-write # print only
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, pool_manager, provenance, replace_section  # noqa: E402

from tessera.pipeline.checker import check  # noqa: E402
from tessera.pipeline.measure import boundary_idle, measure_steps  # noqa: E402
from tessera.pipeline.schedules import concatenate, continuing_schedule  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402


def worker(rank, world_size, cases, steps, forward_s, repeats):
    """Each case ``repeats`` times; the least-disturbed run (smallest bubble) is kept: a shared machine only
    ever adds delay. Every rank gets every rank's events, so all agree on the choice."""
    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=600))
    try:
        out = {}
        for schedule, m, flush in cases:
            runs = [measure_steps(topo.group("pp"), schedule, m, steps, flush, forward_s=forward_s)
                    for _ in range(repeats)]
            best = min(runs, key=lambda r: r["bubble"])
            out[(schedule, m, flush)] = {"bubble": best["bubble"], "idle": best["idle"]}
        return out
    finally:
        topo.destroy()


def theory(schedule: str, p: int, m: int, steps: int, flush: bool) -> tuple[float, float]:
    """(bubble over the run, mean boundary idle in forward times) of the unit-time simulation (F=1, B=2)."""
    sched = concatenate([continuing_schedule(schedule, p, m, warm=flush or t == 0,
                                             lookahead=not flush and t < steps - 1) for t in range(steps)])
    report = check(sched)
    idle = [x for row in boundary_idle(report.intervals, m, steps) for x in row[1:]]  # steady boundaries
    return report.bubble, statistics.mean(idle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--forward-s", type=float, default=0.03)
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the least disturbed is kept")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/PIPELINE.md alone")
    args = parser.parse_args()
    p, f = args.ranks, args.forward_s
    if any(m < p for m in args.microbatches):
        parser.error(f"--microbatches must be at least --ranks ({p}): a pipeline without a flush needs m >= p.")
    cases = [(s, m, flush) for s in ("pipedream", "2bw") for m in args.microbatches for flush in (True, False)]
    with pool_manager() as pools:
        res = pools.run(worker, p, timeout=3000.0, cases=cases, steps=args.steps, forward_s=f,
                        repeats=args.repeats)[0]
    rows = []
    for s, m, flush in cases:
        r = res[(s, m, flush)]
        steady = [x for row in r["idle"] for x in row[1:]]  # boundaries 1.. (0 holds the first warm-up)
        bubble_th, idle_th = theory(s, p, m, args.steps, flush)
        rows.append(f"| {s} | {m} | {'yes' if flush else 'no'} | {r['bubble']:.3f} | {bubble_th:.3f} | "
                    f"{statistics.mean(steady) / f:.2f} | {idle_th:.2f} |")
        print(rows[-1], flush=True)
    lines = [f"{provenance()} p = {p} gloo ranks, TimedStage stages sleeping forward {f * 1e3:.0f} ms and backward "
             f"twice that; {args.steps} consecutive optimizer steps per run (no flush: each step handed the next "
             f"one's micro-batches, the last one drains), the least disturbed of {args.repeats} runs per row. "
             "Bubble = 1 − compute time / (p × wall window) over the whole run; boundary idle = a rank's idle "
             "time from its last forward of step t to its first backward of step t+1, in forward times, averaged "
             "over ranks and the steady boundaries t ≥ 1. Theory: the checker's unit-time simulation of the same "
             "action lists (F = 1, B = 2).", "",
             "| schedule | m | flush | measured bubble | theory | boundary idle (F) | theory (F) |",
             "|---|---|---|---|---|---|---|", *rows]
    if not args.no_write:
        replace_section(DOCS / "PIPELINE.md", "noflush", "PipeDream without a flush", lines)


if __name__ == "__main__":
    main()
