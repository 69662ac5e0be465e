"""tessera's reduce-scatter and all-gather on gloo against gloo's own calls (torch's), same tensors, one run.

What ZeRO moves every step, at the small preset's size (3.03M fp32 elements: the gradients it
reduce-scatters and the parameters it all-gathers). gloo's ``reduce_scatter_tensor`` all-reduces a clone of
the whole input and copies out the slice; tessera's (``tessera.comm.gloo``) sends chunk j to rank j and adds
what it receives, in rank order. gloo's ``all_gather_into_tensor`` gathers into a buffer of its own and
copies it out; tessera's, from 1 MiB on, is one broadcast per rank straight into the output. Each round
times every variant in turn (rotated by one each round), ``--steps`` calls after ``--warmup``; a call's
time is the slowest rank's median; ratios are per round, shown as median (min–max).

    python benchmarks/gloo_collectives.py                       # 2 and 4 ranks, table into docs/BENCHMARKS.md
    python benchmarks/gloo_collectives.py --ranks 2 --rounds 1 --no-write    # smoke run
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (DOCS, MIN_ROUNDS, bench_parser, interleaved_times, pool_manager, provenance,  # noqa: E402
                     replace_section, slowest_medians, spread)

from tessera.models import model_config  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402

VARIANTS = ("rs_gloo", "rs_tessera", "ag_gloo", "ag_tessera")
PAIRS = (("reduce-scatter", "rs_tessera", "rs_gloo"), ("all-gather", "ag_tessera", "ag_gloo"))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_worker(rank, world_size, numel, rounds, steps, warmup):
    import torch.distributed as dist

    from tessera import comm

    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size))
    try:
        group = topo.group("dp_shard")
        n = numel // world_size
        full = torch.randn(n * world_size, generator=torch.Generator().manual_seed(rank))
        out, gathered = torch.empty(n), torch.empty(n * world_size)
        mine = gathered.narrow(0, rank * n, n)  # ZeRO's slice: a view into the flat parameters
        calls = {
            "rs_gloo": lambda: dist.reduce_scatter_tensor(out, full, group=group.pg),
            "rs_tessera": lambda: comm.reduce_scatter(out, full, group),
            "ag_gloo": lambda: dist.all_gather_into_tensor(gathered, mine, group=group.pg),
            "ag_tessera": lambda: comm.all_gather(gathered, mine, group),
        }
        times = interleaved_times({k: partial(_timed, calls[k]) for k in VARIANTS}, rounds, warmup, steps)
        return {"times": times}
    finally:
        topo.destroy()


def table(results: dict[int, list[dict]]) -> list[str]:
    rows = ["| ranks | collective | gloo's (ms) | tessera's (ms) | tessera ÷ gloo |", "|---|---|---|---|---|"]
    for world, per_rank in results.items():
        per_round = {k: slowest_medians([r["times"][k] for r in per_rank]) for k in VARIANTS}
        for name, ours, theirs in PAIRS:
            ratio = [a / b for a, b in zip(per_round[ours], per_round[theirs])]
            ms = {k: statistics.median(per_round[k]) * 1e3 for k in (ours, theirs)}
            rows.append(f"| {world} | {name} | {ms[theirs]:.2f} | {ms[ours]:.2f} | {spread(ratio)} |")
    return rows


def main() -> None:
    args = bench_parser(__doc__, ranks=[2, 4], preset="small", batch=0, seq=0, rounds=MIN_ROUNDS, steps=5,
                        warmup=1).parse_args()
    numel = model_config(args.preset).num_params()
    results = {}
    with pool_manager() as pools:
        for world in args.ranks:
            results[world] = pools.run(bench_worker, world, timeout=1200.0, numel=numel - numel % world,
                                       rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    lines = [f"{provenance()} fp32 tensors of the `{args.preset}` preset's {numel / 1e6:.2f}M parameters (the full size "
             f"reduce-scattered or gathered); {args.rounds} interleaved rounds of {args.warmup} warm-up + "
             f"{args.steps} timed calls per variant. A call = the slowest rank's median in a round, the "
             "median over rounds; ratio = per round, median (min–max).", "", *table(results)]
    print("\n".join(lines))
    if not args.no_write:
        replace_section(DOCS / "BENCHMARKS.md", "gloo", "tessera's collectives on gloo (CPU)", lines)


if __name__ == "__main__":
    main()
