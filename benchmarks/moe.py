"""Expert parallelism against the same MoE replicated under DDP: step time and expert memory per rank.

Both run in the same gloo world, in the same processes, interleaved A B A B over several rounds:
A = tessera expert parallelism as ``tessera train --parallel.ep=N`` builds it (``tessera.parallelize.parallelize``
with the default ``[ddp]`` settings: experts sharded over ep, tokens by all-to-all, dense gradients
all-reduced over dp and expert gradients over edp, here of size 1, both in buckets from the gradient hooks);
B = the same MoE model, every expert on every rank, under torch.nn.parallel.DistributedDataParallel with
the same bucket cap. A step is forward + backward + AdamW (the same AdamW arguments on both sides); both
sides step on the global mean loss (A sums gradients of loss / global tokens, B averages gradients of
loss / local tokens). Expert-parameter memory per rank is counted from the live parameters of each rank's
model, after timing.

    python benchmarks/moe.py                     # 2 and 4 ranks, moe-small, writes docs/BENCHMARKS.md
    python benchmarks/moe.py --ranks 2 --rounds 1 --steps 1 --warmup 1 --no-write
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (DOCS, MIN_ROUNDS, ab_summary, bench_parser, interleaved_times,  # noqa: E402
                     no_forward_buffer_sync, pool_manager, provenance, replace_section, spread, token_batch)

from tessera.models import Transformer, cross_entropy_sum, model_config  # noqa: E402
from tessera.models.moe import MoEConfig, moe_layers, moe_loss_sum  # noqa: E402
from tessera.data_parallel import DDPConfig  # noqa: E402
from tessera.parallelize import parallelize  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402

DOC = DOCS / "BENCHMARKS.md"


def _step(model, opt, x, y, ranks_in_divisor) -> float:
    """One step; the summed loss is divided by n·ranks_in_divisor tokens: the global count (world) for
    tessera's sum reduction, the local count (1) for torch DDP's average (equal batches on every rank)."""
    t0 = time.perf_counter()
    ce, n = cross_entropy_sum(model(x), y)
    ((ce + moe_loss_sum(model)) / (n * ranks_in_divisor)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for layer in moe_layers(model) for p in layer.experts.parameters())


def bench_worker(rank, world_size, preset, top_k, batch, seq, rounds, steps, warmup):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    topo = Topology.build(ParallelConfig(dp_replicate=world_size, ep=world_size))
    try:
        ddp = DDPConfig()  # what `tessera train` uses without a [ddp] section

        def build(kind):
            torch.manual_seed(0)
            core = Transformer(model_config(preset), MoEConfig(top_k=top_k))
            if kind == "ep":  # the trainer's assembly: ep > 1 → expert_parallelize(model, topology, ddp)
                model = parallelize(core, topo, ddp)
            else:
                model = TorchDDP(core, process_group=dist.group.WORLD, bucket_cap_mb=ddp.bucket_mb,
                                 **no_forward_buffer_sync())
            return model, core, torch.optim.AdamW(core.parameters(), lr=1e-4, foreach=False)

        models = {kind: build(kind) for kind in ("ep", "ddp")}
        x, y = token_batch(rank, batch, seq)
        a2a_per_step = 0.0

        @contextmanager
        def count_all_to_all(kind):  # ep-axis all-to-all wire bytes of EP's timed steps (the last round's)
            nonlocal a2a_per_step
            before = topo.ledger.stats()
            yield
            if kind == "ep":
                a2a = topo.ledger.since(before).get(("ep", "all_to_all"))
                a2a_per_step = a2a.wire_bytes / steps if a2a else 0.0

        divisor = {"ep": world_size, "ddp": 1}
        steppers = {kind: partial(_step, model, opt, x, y, divisor[kind]) for kind, (model, _, opt) in models.items()}
        times = interleaved_times(steppers, rounds, warmup, steps, around=count_all_to_all)
        mem = {kind: {"expert": _expert_bytes(core), "total": sum(p.numel() * 4 for p in core.parameters())}
               for kind, (_, core, _) in models.items()}
        return {"times": times, "mem": mem, "a2a": a2a_per_step}
    finally:
        topo.destroy()


def write_doc(rows: list[str], args, params: int) -> None:
    replace_section(DOC, "moe", "Mixture of experts: expert parallelism vs replicated experts under DDP", [
        f"{provenance()} Model: `{args.preset}` ({params / 1e6:.2f}M "
        f"parameters; 2 MoE layers of 8 experts), top-{args.top_k}, capacity factor 1.25; per rank a batch of "
        f"{args.batch}×{args.seq} tokens; AdamW (lr 1e-4, foreach off, on both sides); {args.rounds} interleaved "
        f"rounds of {args.warmup} warm-up + {args.steps} timed steps. A = tessera expert parallelism with ep = "
        "ranks, built by `parallelize()` as `tessera train` builds it (ExpertDataParallel: dense gradients over "
        "dp, expert gradients over edp, default `[ddp]` bucket cap 25 MiB); B = the same MoE replicated under "
        "torch DDP with the same bucket cap. Step = median over a round on the slowest rank, then the median "
        "over rounds; ratio = per round A / B, shown as median (min–max over rounds). "
        "Expert MiB = fp32 expert parameters held by one rank; all-to-all = ep-axis wire bytes per step and rank "
        "(forward dispatch + combine + counts, backward both inverses, 2 MoE layers). On CPU the ranks share "
        "2 cores, so the time shows relative cost only.",
        "",
        "| ranks = ep | EP step (s) | DDP step (s) | ratio EP/DDP | expert MiB/rank EP | expert MiB/rank DDP | "
        "DDP/EP memory | params MiB/rank EP / DDP | all-to-all MiB/step |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> None:
    parser = bench_parser(__doc__, ranks=[2, 4], preset="moe-small", batch=4, seq=128, rounds=MIN_ROUNDS,
                          steps=3, warmup=1)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    params = model_config(args.preset).num_params()
    rows = []
    with pool_manager() as pools:
        for world in args.ranks:
            res = pools.run(bench_worker, world, timeout=3600.0, preset=args.preset, top_k=args.top_k,
                            batch=args.batch, seq=args.seq, rounds=args.rounds, steps=args.steps,
                            warmup=args.warmup)
            s, mem = ab_summary([r["times"] for r in res], "ep", "ddp"), res[0]["mem"]
            mib = lambda b: b / 2**20  # noqa: E731
            rows.append(
                f"| {world} | {statistics.median(s['ep']):.3f} | {statistics.median(s['ddp']):.3f} "
                f"| **{spread(s['ratio'])}** | {mib(mem['ep']['expert']):.2f} "
                f"| {mib(mem['ddp']['expert']):.2f} | **{mem['ddp']['expert'] / mem['ep']['expert']:.2f}×** "
                f"| {mib(mem['ep']['total']):.2f} / {mib(mem['ddp']['total']):.2f} "
                f"| {mib(max(r['a2a'] for r in res)):.2f} |")
            print(rows[-1], flush=True)
    if not args.no_write:
        write_doc(rows, args, params)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
