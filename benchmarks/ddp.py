"""tessera DDP against torch.nn.parallel.DistributedDataParallel: step time, same model, same ranks.

Both run in the same gloo world, in the same processes, interleaved A B A B over several rounds, so that
the noise of a shared machine hits both alike. A step is forward + backward (with bucketed all-reduce)
+ AdamW update. The ratio reported is the median over rounds of (tessera median / torch median).

    python benchmarks/ddp.py                      # 2 and 4 ranks, small preset, writes docs/BENCHMARKS.md
    python benchmarks/ddp.py --ranks 2 --rounds 3 --no-write
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from tessera.data_parallel import DistributedDataParallel
from tessera.models import Transformer, model_config
from tessera.topology import ParallelConfig, Topology

DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
BEGIN, END = "<!-- ddp:begin -->", "<!-- ddp:end -->"


def _step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    logits = model(x)
    nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _no_forward_buffer_sync() -> dict:
    """torch renamed the switch; newer versions warn on the old name."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    params = inspect.signature(TorchDDP.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


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
                                 **_no_forward_buffer_sync())
            return model, torch.optim.AdamW(core.parameters(), lr=1e-4)

        models = {kind: build(kind) for kind in ("tessera", "torch")}
        g = torch.Generator().manual_seed(rank)
        data = torch.randint(0, 256, (batch, seq + 1), generator=g)
        x, y = data[:, :-1], data[:, 1:]
        times = {kind: [] for kind in models}
        for _ in range(rounds):
            for kind, (model, opt) in models.items():  # A then B, every round
                for _ in range(warmup):
                    _step(model, opt, x, y)
                dist.barrier()
                times[kind].append([_step(model, opt, x, y) for _ in range(steps)])
        return times
    finally:
        topo.destroy()


def summarize(times: list[dict]) -> dict:
    """Per round, the slowest rank's median step (the job moves at the pace of its slowest rank)."""
    rounds = len(times[0]["tessera"])
    out = {"tessera": [], "torch": [], "ratio": []}
    for i in range(rounds):
        med = {k: max(statistics.median(t[k][i]) for t in times) for k in ("tessera", "torch")}
        out["tessera"].append(med["tessera"])
        out["torch"].append(med["torch"])
        out["ratio"].append(med["tessera"] / med["torch"])
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, gloo"


def write_doc(rows: list[str], args, params: int) -> None:
    table = [
        BEGIN,
        f"Measured by `python benchmarks/ddp.py` on {machine()}. Model: `{args.preset}` preset "
        f"({params / 1e6:.2f}M parameters, {params * 4 / 2**20:.1f} MiB of fp32 gradients); per rank a "
        f"batch of {args.batch}×{args.seq} tokens; AdamW; bucket {args.bucket_mb} MiB for both; "
        f"{args.rounds} interleaved rounds of {args.warmup} warm-up + {args.steps} timed steps each. "
        "Step time = median over a round's steps on the slowest rank; ratio = median over rounds of "
        "tessera / torch. Target: ratio ≤ 1.05.",
        "",
        "| ranks | tessera step (s) | torch DDP step (s) | ratio tessera/torch | ratio per round |",
        "|---|---|---|---|---|",
        *rows,
        END,
    ]
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else "# Benchmarks\n"
    block = "\n".join(table)
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## Data parallel: tessera DDP vs torch DDP (CPU, gloo)\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text, encoding="utf-8")


def main() -> None:
    from tessera.testing import PoolManager

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    params = model_config(args.preset).num_params()
    pools, rows = PoolManager(pg_timeout_s=600.0), []
    try:
        for world in args.ranks:
            times = pools.run(bench_worker, world, timeout=3600.0, preset=args.preset, batch=args.batch,
                              seq=args.seq, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                              bucket_mb=args.bucket_mb)
            s = summarize(times)
            ratio = statistics.median(s["ratio"])
            rows.append(f"| {world} | {statistics.median(s['tessera']):.4f} | {statistics.median(s['torch']):.4f} "
                        f"| **{ratio:.3f}** | {', '.join(f'{r:.3f}' for r in s['ratio'])} |")
            print(rows[-1], flush=True)
    finally:
        pools.close_all()
    if not args.no_write:
        write_doc(rows, args, params)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
