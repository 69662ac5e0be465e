"""Parameter server: examples/s for 1, 2 and 4 servers (fixed workers), and bytes per step vs all-reduce.

    python benchmarks/parameter_server.py              # writes the parameter_server section of docs/BENCHMARKS.md
    python benchmarks/parameter_server.py --no-write --servers 1 --rounds 1 --steps 2 --dense-ranks 2  # quick check

Throughput: BSP jobs of W workers on the wide & deep CTR model, servers S in {1, 2, 4}, interleaved
(S=1, S=2, S=4, torch, S=1, ...) with a single-process torch baseline on the same global batch.
examples/s counts the training loop only (process start-up excluded), on the slowest worker, and for the
baseline its loop alone (clocked inside the run: set-up and final evaluation excluded); the ratio
against one process is taken per round and shown as median (min–max over rounds).
Bytes: per step through the busiest server (pulled rows + pushed sparse gradients + dense tensors),
measured by the workers' CommLedger, against a ring all-reduce of the same tables over the W workers
(2(W-1)/W x table bytes), for two table sizes. Dense model: busiest-rank wire bytes per step of a
parameter server on rank 0, a sharded parameter server and a ring all-reduce, from the CommLedger.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, MIN_ROUNDS, pool_manager, provenance, replace_section, spread  # noqa: E402

from tessera.models.ctr import SPARSE_TABLES  # noqa: E402
from tessera.parameter_server import PSConfig, run_ps_job  # noqa: E402
from tessera.parameter_server.reference import train_single_process  # noqa: E402

DOC = DOCS / "BENCHMARKS.md"


def dense_bench_worker(rank, world_size, strategy):
    """One step of a 1.1M-parameter MLP's dense exchange: this rank's wire bytes."""
    from torch import nn

    from tessera.parameter_server.dense import DenseParameterSync
    from tessera.topology import ParallelConfig, Topology

    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
        sync = DenseParameterSync(model, topo.group("dp"), strategy, lambda ps: torch.optim.SGD(ps, lr=0.1))
        model(torch.randn(4, 512)).sum().backward()
        before = topo.ledger.stats()
        sync.step()
        return sum(s.wire_bytes for s in topo.ledger.since(before).values())
    finally:
        topo.destroy()


def single_process_loop_seconds(cfg: PSConfig, steps: int) -> float:
    """Seconds of one run's training loop alone, as the PS workers' clock counts (model, data and the final
    evaluation outside it)."""
    return train_single_process(cfg, steps)["loop_seconds"]


def throughput(args) -> list[str]:
    runs: dict[str, list[float]] = {}
    train_single_process(PSConfig(batch_size=8), 1)  # warm-up: torch's first optimizer step imports a lot
    for _ in range(args.rounds):
        for servers in args.servers:
            cfg = PSConfig(servers=servers, workers=args.workers, batch_size=args.batch, buckets=args.buckets)
            s = run_ps_job(cfg, args.steps)
            runs.setdefault(f"{servers}", []).append(s["examples_per_s"])
            print(f"servers={servers}: {s['examples_per_s']:.0f} examples/s", flush=True)
        cfg = PSConfig(workers=args.workers, batch_size=args.batch, buckets=args.buckets)
        eps = args.steps * args.workers * args.batch / single_process_loop_seconds(cfg, args.steps)
        runs.setdefault("torch", []).append(eps)
        print(f"single-process torch: {eps:.0f} examples/s", flush=True)
    base = runs["torch"]
    rows = [f"| {k} | {statistics.median(v):.0f} | {spread([x / b for x, b in zip(v, base)], 2)} |"
            for k, v in runs.items() if k != "torch"]
    rows.append(f"| one process, torch (no PS) | {statistics.median(base):.0f} | 1.00 |")
    return rows


def sparse_bytes(args) -> list[str]:
    rows = []
    for buckets in args.table_buckets:
        cfg = PSConfig(servers=2, workers=args.workers, batch_size=args.batch, buckets=buckets)
        s = run_ps_job(cfg, args.bytes_steps, want_params=True)
        per_server = [sum(b[i] for b in s["bytes_per_worker"].values()) / args.bytes_steps for i in range(2)]
        table = sum(s["params"][n].numel() * 4 for n in SPARSE_TABLES)
        dense = sum(p.numel() * 4 for n, p in s["params"].items() if n not in SPARSE_TABLES)
        ring = 2 * (args.workers - 1) / args.workers * (table + dense)
        rows.append(f"| {cfg.fields}×{buckets} rows × (8+1) fp32 ({table / 2**20:.1f} MiB) | "
                    f"{max(per_server) / 2**10:.1f} | {ring / 2**10:.1f} | {ring / max(per_server):.1f}× |")
        print(rows[-1], flush=True)
    return rows


def dense_bytes(args) -> list[str]:
    rows = []
    with pool_manager(pg_timeout_s=60.0) as pools:  # PoolManager's default timeout, as before
        for world in args.dense_ranks:
            cells = []
            for strategy in ("ps_rank0", "ps_sharded", "allreduce"):
                wire = pools.run(dense_bench_worker, world, timeout=600.0, strategy=strategy)
                cells.append(f"{max(wire) / 2**20:.2f}")
            rows.append(f"| {world} | {' | '.join(cells)} |")
            print(rows[-1], flush=True)
    return rows


def write_doc(args, tput, sparse, dense) -> None:
    replace_section(DOC, "parameter_server", "Parameter server (CPU, TensorPipe RPC and gloo)", [
        f"{provenance()} Servers and workers share the cores, so more servers cannot help here. CTR wide & "
        f"deep model, 8 fields, embedding width 8, hidden 32; {args.workers} workers × {args.batch} samples per "
        "step; BSP; Adagrad on the servers; RPC over TensorPipe on loopback.",
        "",
        f"Throughput, {args.buckets} buckets per field, {args.steps} steps, {args.rounds} interleaved rounds "
        "(examples/s of the training loop on the slowest worker, median over rounds; ratio against one torch "
        "process on the same global batch, its training loop alone too, per round, shown as median (min–max "
        "over rounds)):",
        "",
        "| servers | examples/s | vs one process |",
        "|---|---|---|",
        *tput,
        "",
        f"Bytes per step through the busiest of 2 servers vs a ring all-reduce of the same model over "
        f"{args.workers} workers ({args.bytes_steps} steps):",
        "",
        "| sparse tables | PS busiest server (KiB/step) | ring all-reduce per rank (KiB/step) | all-reduce / PS |",
        "|---|---|---|---|",
        *sparse,
        "",
        "Dense model (MLP 512-1024-512, 1.05M parameters, 4.0 MiB of gradients): wire MiB per step through the "
        "busiest rank (CommLedger):",
        "",
        "| ranks | PS on rank 0 | sharded PS | ring all-reduce |",
        "|---|---|---|---|",
        *dense,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--buckets", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--table-buckets", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--bytes-steps", type=int, default=10)
    parser.add_argument("--dense-ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    tput = throughput(args)
    sparse = sparse_bytes(args)
    dense = dense_bytes(args)
    if not args.no_write:
        write_doc(args, tput, sparse, dense)


if __name__ == "__main__":
    main()
