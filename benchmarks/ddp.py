"""tessera DDP against torch.nn.parallel.DistributedDataParallel: step time, same model, same ranks.

Both run in the same gloo world, in the same processes, interleaved A B A B over several rounds, so that
the noise of a shared machine hits both alike. A step is forward + backward (with bucketed all-reduce)
+ AdamW update (the same AdamW arguments on both sides). Both sides get the same bucket cap, small enough
that the model's gradients span several buckets (2 MiB against the small preset's 11.6 MiB), so the
comparison exercises bucketing and the overlap of all-reduce with backward; each side's bucket count is
printed and recorded. The ratio reported is the median over rounds of (tessera median / torch median), with
its min–max over rounds.

    python benchmarks/ddp.py                      # 2 and 4 ranks, small preset, writes docs/BENCHMARKS.md
    python benchmarks/ddp.py --ranks 2 --rounds 1 --steps 1 --warmup 1 --no-write
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (DOCS, MIN_ROUNDS, ab_summary, bench_parser, interleaved_times,  # noqa: E402
                     no_forward_buffer_sync, pool_manager, provenance, replace_section, spread, token_batch)

from tessera.data_parallel import DistributedDataParallel  # noqa: E402
from tessera.models import Transformer, model_config  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402

DOC = DOCS / "BENCHMARKS.md"
# Steps each side runs before the timed rounds: torch DDP reduces everything in one bucket until it rebuilds
# its buckets in gradient-arrival order, at the start of its third step; every timed step comes after.
SETTLE_STEPS = 3


def _step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    logits = model(x)
    nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def torch_buckets(model) -> int:
    """How many gradient buckets torch DDP reduces now: after its first steps it rebuilds them in the order
    gradients arrived (``rebuilt_bucket_sizes``); before that, its initial ``bucket_sizes``."""
    info = model._get_ddp_logging_data()
    sizes = info.get("rebuilt_bucket_sizes") or info.get("bucket_sizes", "")
    return len([s for s in str(sizes).split(",") if s.strip()])


def bench_worker(rank, world_size, preset, batch, seq, rounds, steps, warmup, bucket_mb):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        def build(kind):
            torch.manual_seed(0)
            core = Transformer(model_config(preset))
            if kind == "tessera":
                model = DistributedDataParallel(core, topo.group("dp"), bucket_mb=bucket_mb)
            else:  # buffers here are constant RoPE tables, synced once at start like tessera does
                model = TorchDDP(core, process_group=dist.group.WORLD, bucket_cap_mb=bucket_mb,
                                 **no_forward_buffer_sync())
            return model, torch.optim.AdamW(core.parameters(), lr=1e-4, foreach=False)

        models = {kind: build(kind) for kind in ("tessera", "torch")}
        x, y = token_batch(rank, batch, seq)
        steppers = {kind: partial(_step, model, opt, x, y) for kind, (model, opt) in models.items()}
        for step in steppers.values():  # untimed: torch DDP rebuilds its buckets after its first steps
            for _ in range(SETTLE_STEPS):
                step()
        times = interleaved_times(steppers, rounds, warmup, steps)
        buckets = {"tessera": len(models["tessera"][0].buckets), "torch": torch_buckets(models["torch"][0])}
        return {"times": times, "buckets": buckets}
    finally:
        topo.destroy()


def write_doc(rows: list[str], args, params: int) -> None:
    replace_section(DOC, "ddp", "Data parallel: tessera DDP vs torch DDP (CPU, gloo)", [
        f"{provenance()} Model: `{args.preset}` preset ({params / 1e6:.2f}M parameters, "
        f"{params * 4 / 2**20:.1f} MiB of fp32 gradients); per rank a batch of {args.batch}×{args.seq} tokens; "
        f"AdamW (lr 1e-4, foreach off, on both sides); bucket cap {args.bucket_mb:g} MiB for both (tessera "
        "`bucket_mb`, torch `bucket_cap_mb`), so the gradients span several buckets on each side (the bucket "
        "columns: tessera's buckets, and torch's after its rebuild in gradient-arrival order); "
        f"{SETTLE_STEPS} untimed steps per side, then {args.rounds} interleaved rounds of {args.warmup} warm-up + "
        f"{args.steps} timed steps each. "
        "Step time = median over a round's steps on the slowest rank, then the median over rounds; ratio = "
        "per round tessera / torch, shown as median (min–max over rounds). Target: ratio ≤ 1.00.",
        "",
        "| ranks | buckets tessera / torch | tessera step (s) | torch DDP step (s) | ratio tessera/torch |",
        "|---|---|---|---|---|",
        *rows,
    ])


def main() -> None:
    parser = bench_parser(__doc__, ranks=[2, 4], preset="small", batch=8, seq=128, rounds=MIN_ROUNDS, steps=5,
                          warmup=2)
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    args = parser.parse_args()
    params = model_config(args.preset).num_params()
    rows = []
    with pool_manager() as pools:
        for world in args.ranks:
            res = pools.run(bench_worker, world, timeout=3600.0, preset=args.preset, batch=args.batch,
                            seq=args.seq, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                            bucket_mb=args.bucket_mb)
            s = ab_summary([r["times"] for r in res], "tessera", "torch")  # per round, the slowest rank's median
            b = res[0]["buckets"]
            rows.append(f"| {world} | {b['tessera']} / {b['torch']} | {statistics.median(s['tessera']):.4f} "
                        f"| {statistics.median(s['torch']):.4f} | **{spread(s['ratio'])}** |")
            print(rows[-1], flush=True)
    if not args.no_write:
        write_doc(rows, args, params)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
