"""Measure this machine: the matmul rate of one rank and gloo all-reduce α and β between local ranks.

The only part of the planner that runs anything: it spawns its own ranks (spawn start method, a FileStore
in a temporary folder, an explicit timeout), times all-reduces of several sizes, and fits the ring model
t(S) = 2(n−1)·α + 2(n−1)/n·S/β by least squares. A few seconds on two cores.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta

import torch

SIZES = (4 * 2**10, 256 * 2**10, 4 * 2**20, 16 * 2**20)  # bytes per all-reduce


def matmul_flops(n: int = 512, seconds: float = 0.75, threads: int = 1, dtype=torch.float32) -> float:
    """FLOP/s of an n×n×n matmul on ``threads`` threads (one rank's share of the CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            reps += 1
        return 2.0 * n**3 * reps / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)


def _allreduce_rank(rank: int, world: int, store_path: str, out_path: str, reps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        dist.barrier()
        step_rate = torch.tensor([training_step_flops()])  # every rank at once, as in a real run
        dist.all_reduce(step_rate)
        rows = []
        for size in SIZES:
            x = torch.ones(size // 4)
            dist.all_reduce(x)  # warm-up
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
            rows.append((size, min(times)))  # the least disturbed run: the machine may be shared
        if rank == 0:
            with open(out_path, "w") as fh:
                fh.write(f"{float(step_rate) / world}\n" + "\n".join(f"{s} {t}" for s, t in rows))
    finally:
        dist.destroy_process_group()


def fit_alpha_beta(rows, world: int) -> tuple[float, float]:
    """α, β from (bytes, seconds) of ring all-reduces over ``world`` ranks: the slope between the two
    largest sizes gives β, the smallest size (latency-bound) gives α."""
    rows = sorted(rows)
    (s1, t1), (s2, t2) = rows[-2], rows[-1]
    slope = max((t2 - t1) / (s2 - s1), 1e-15)
    intercept = max(rows[0][1] - slope * rows[0][0], 0.0)
    alpha = intercept / (2 * (world - 1))
    beta = 2.0 * (world - 1) / world / slope
    return alpha, beta


def allreduce_alpha_beta(world: int = 2, reps: int = 10) -> tuple[float, float, list, float]:
    """Spawn ``world`` gloo ranks, time a reference training step on all of them at once and then
    all-reduces; return (α seconds, β bytes/s, raw rows, mean step FLOP/s per rank)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "times")
        mp.start_processes(_allreduce_rank, args=(world, store, out, reps), nprocs=world, join=True,
                           start_method="spawn")
        with open(out) as fh:
            first, *lines = fh.read().splitlines()
        rows = [(int(s), float(t)) for s, t in (line.split() for line in lines)]
    alpha, beta = fit_alpha_beta(rows, world)
    return alpha, beta, rows, float(first)


def training_step_flops(preset: str = "small", rows: int = 4, seq: int = 128, steps: int = 3) -> float:
    """FLOP/s one rank reaches training tessera's reference model (model FLOPs / fastest step time, one
    thread): the rate small CPU runs really get, well below a large matmul's, since norms, softmax, the
    optimizer and framework overhead weigh as much as the matmuls at these sizes."""
    from tessera.models import Transformer, cross_entropy_sum, model_config

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = model_config(preset)
        torch.manual_seed(0)
        model = Transformer(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, cfg.vocab_size, (rows, seq))
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            s, n = cross_entropy_sum(model(x), x)
            (s / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return cfg.flops_per_token(seq) * rows * seq / min(times[1:])  # the least disturbed step
    finally:
        torch.set_num_threads(before)


def calibrate(world: int = 2) -> dict:
    """This machine's numbers in the form ``planner.local.local_gpu`` takes: ``peak_flops`` (a 512³
    matmul), ``step_flops`` (a reference-model training step run on all ``world`` ranks at once, so that
    cores the ranks share count; it sets the compute efficiency), ``alpha_s`` and ``bytes_per_s`` (gloo
    ring all-reduce on ``world`` ranks); ``step_flops_alone`` is the same step in one process, for
    single-rank plans."""
    start = time.perf_counter()
    peak = matmul_flops()
    alone = training_step_flops()
    alpha, beta, rows, step = allreduce_alpha_beta(world)
    return {"peak_flops": peak, "step_flops": step, "step_flops_alone": alone, "alpha_s": alpha,
            "bytes_per_s": beta, "ranks": world, "cores": os.cpu_count() or 1,
            "allreduce_samples": [{"bytes": s, "seconds": t} for s, t in rows],
            "seconds_taken": time.perf_counter() - start}
