"""tessera DDP against torch.nn.parallel.DistributedDataParallel: step time, same model, same ranks.

Both run in the same gloo world, in the same processes, interleaved A B A B over several rounds, so that
the noise of a shared machine hits both alike. A step is forward + backward (with bucketed all-reduce)
+ AdamW update. The ratio reported is the median over rounds of (tessera median / torch median).

    python benchmarks/ddp.py                      # 2 and 4 ranks, small preset, writes docs/BENCHMARKS.md
    python benchmarks/ddp.py --ranks 2 --rounds 3 --no-write
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
from _common import (DOCS, ab_summary, bench_parser, command_line, interleaved_times, machine,  # noqa: E402
                     no_forward_buffer_sync, pool_manager, replace_section, token_batch)

from tessera.data_parallel import DistributedDataParallel  # noqa: E402
from tessera.models import Transformer, model_config  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402

DOC = DOCS / "BENCHMARKS.md"


def _step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    logits = model(x)
    nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


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
            return model, torch.optim.AdamW(core.parameters(), lr=1e-4)

        models = {kind: build(kind) for kind in ("tessera", "torch")}
        x, y = token_batch(rank, batch, seq)
        return interleaved_times({kind: partial(_step, model, opt, x, y) for kind, (model, opt) in models.items()},
                                 rounds, warmup, steps)
    finally:
        topo.destroy()


def write_doc(rows: list[str], args, params: int) -> None:
    replace_section(DOC, "ddp", "Data parallel: tessera DDP vs torch DDP (CPU, gloo)", [
        f"Measured by `{command_line()}` on {machine()}. Model: `{args.preset}` preset "
        f"({params / 1e6:.2f}M parameters, {params * 4 / 2**20:.1f} MiB of fp32 gradients); per rank a "
        f"batch of {args.batch}×{args.seq} tokens; AdamW; bucket {args.bucket_mb} MiB for both; "
        f"{args.rounds} interleaved rounds of {args.warmup} warm-up + {args.steps} timed steps each. "
        "Step time = median over a round's steps on the slowest rank; ratio = median over rounds of "
        "tessera / torch. Target: ratio ≤ 1.05.",
        "",
        "| ranks | tessera step (s) | torch DDP step (s) | ratio tessera/torch | ratio per round |",
        "|---|---|---|---|---|",
        *rows,
    ])


def main() -> None:
    parser = bench_parser(__doc__, ranks=[2, 4], preset="small", batch=8, seq=128, rounds=5, steps=5, warmup=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    params = model_config(args.preset).num_params()
    rows = []
    with pool_manager() as pools:
        for world in args.ranks:
            times = pools.run(bench_worker, world, timeout=3600.0, preset=args.preset, batch=args.batch,
                              seq=args.seq, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                              bucket_mb=args.bucket_mb)
            s = ab_summary(times, "tessera", "torch")  # per round, the slowest rank's median step
            ratio = statistics.median(s["ratio"])
            rows.append(f"| {world} | {statistics.median(s['tessera']):.4f} | {statistics.median(s['torch']):.4f} "
                        f"| **{ratio:.3f}** | {', '.join(f'{r:.3f}' for r in s['ratio'])} |")
            print(rows[-1], flush=True)
    if not args.no_write:
        write_doc(rows, args, params)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
