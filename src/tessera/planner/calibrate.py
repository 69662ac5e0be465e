"""Measure this machine: the matmul rate of one rank and gloo all-reduce α and β between local ranks.

The only part of the planner that runs anything: it times the reference step's single-thread pieces in
the same rounds (tessera.planner.reference_step), starts its own ranks (tessera.spawn; a FileStore in a
temporary folder, an explicit timeout), times all-reduces of several sizes, and fits the ring model
t(S) = 2(n−1)·α + 2(n−1)/n·S/β by least squares. About twenty seconds on two cores.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch

from tessera.planner import reference_step as ref
from tessera.planner.reference_step import REFERENCE, fastest, one_thread  # noqa: F401 (REFERENCE: re-exported)

SIZES = (4 * 2**10, 256 * 2**10, 4 * 2**20, 16 * 2**20)  # bytes per all-reduce
SYNC_BYTES = 512 * 2**10  # the interleaved all-reduce: one tensor-parallel all-reduce of the reference step


def matmul_flops(n: int = 512, seconds: float = 0.75, threads: int = 1, dtype=torch.float32) -> float:
    """FLOP/s of an n×n×n matmul on ``threads`` threads (one rank's share of the CPU)."""
    with one_thread(threads):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            reps += 1
        return 2.0 * n**3 * reps / (time.perf_counter() - start)


def _interleaved_allreduce(dist, reps: int = 20, rounds: int = 11) -> float:
    """Seconds a SYNC_BYTES all-reduce adds to a segment of compute when every segment ends with one, as a
    tensor-parallel rank issues them: each round times ``reps`` segments alone, then ``reps`` with the
    all-reduce; the median over rounds of the paired difference (a change in the machine's load during
    one round hits both halves of its pair, and outlying rounds do not move a median)."""
    x, w = torch.randn(512, 256), torch.randn(688, 256)
    buf = torch.ones(SYNC_BYTES // 4)
    diffs = []
    for _ in range(rounds):
        pair = []
        for communicate in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                x @ w.t()
                if communicate:
                    dist.all_reduce(buf)
            pair.append((time.perf_counter() - t0) / reps)
        diffs.append(pair[1] - pair[0])
    return sorted(diffs)[len(diffs) // 2]


def _allreduce_rank(store_path: str, reps: int):
    """One calibration rank (a tessera.spawn entry); rank 0 returns (the ranks' mean
    :func:`shared_core_efficiency`, interleaved all-reduce seconds, [(bytes, seconds)] of back-to-back
    all-reduces)."""
    import torch.distributed as dist

    from tessera.spawn import process_rank

    rank, world = process_rank()
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        with one_thread():
            run, _ = ref.training_step(*REFERENCE)
            run()  # warm-up
            efficiency = torch.tensor([shared_core_efficiency(run, rank, world, dist.barrier)])
        dist.all_reduce(efficiency)
        interleaved = _interleaved_allreduce(dist)
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
        return (float(efficiency) / world, interleaved, rows) if rank == 0 else None
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


def allreduce_alpha_beta(world: int = 2, reps: int = 10) -> tuple[float, float, list, float, float]:
    """Spawn ``world`` gloo ranks, time the reference training step on all of them at once against each
    alone (:func:`shared_core_efficiency`), all-reduces back to back, and small all-reduces between compute
    segments; return (α seconds, β bytes/s, raw rows, the ranks' mean shared-core efficiency, seconds an
    interleaved SYNC_BYTES all-reduce adds to a segment)."""
    from tessera.spawn import spawn

    with tempfile.TemporaryDirectory() as tmp:  # the ranks rendezvous through a FileStore: no port
        shared, interleaved, rows = spawn(_allreduce_rank, world, (os.path.join(tmp, "store"), reps))[0]
    alpha, beta = fit_alpha_beta(rows, world)
    return alpha, beta, rows, shared, interleaved


def shared_core_efficiency(run, rank: int, world: int, barrier, rounds: int = 7) -> float:
    """How fast one rank runs the reference step ``run`` while every rank runs it at once, as a fraction of
    its speed running it alone (CPU seconds alone ÷ together: how much ranks on the cores of one machine
    slow each other through shared caches and memory). Each round: one step on every rank at once, then
    one step on each rank in turn while the others wait at ``barrier``; the median over ``rounds`` of the
    rank's per-round ratio. Both halves of a ratio are timed within a second, so a shared machine's
    drifting speed hits them alike: three steps timed together and set against a one-process rate
    measured separately gave 0.73 in one calibration and 1.04 in another an hour apart on one host, and
    every multi-rank prediction moved with it."""
    ratios = []
    for _ in range(rounds):
        barrier()
        t0 = time.thread_time()
        run()
        together = time.thread_time() - t0
        for turn in range(world):
            barrier()
            if turn == rank:
                t0 = time.thread_time()
                run()
                alone = time.thread_time() - t0
        ratios.append(alone / together)
    barrier()
    return statistics.median(ratios)


def half_matmul_flops(peak: float, tokens: int = 128, seconds: float = 0.2) -> float:
    """The reference layer's matmul rate in bf16 (what ``precision.dtype = "bf16"`` runs its products in),
    as ``peak`` (the calibration's fp32 layer-matmul rate, reference_step.rates) times the bf16 ÷ fp32 rate of the same
    products on ``tokens`` rows, the two timed in turn. CPUs without bf16 instructions (AVX2) run bf16
    products through torch's reference kernel, tens of times slower than fp32; those with AVX512-BF16 or
    AMX run them faster. A quarter of the fp32 tokens keeps one bf16 pass under a second on the slow kind."""
    with one_thread():
        (half, _), (full, _) = ref.layer_matmuls(tokens, torch.bfloat16), ref.layer_matmuls(tokens)
        best = fastest({"bf16": half, "fp32": full}, seconds)
    return peak * best["fp32"] / best["bf16"]


def _rest(step_flops_alone: float, matmul_flops: float, hbm_bytes_per_s: float, layer_call_s: float = 0.0,
          attention_rate: float = 0.0, attention_row_s: float = 0.0) -> tuple[float, float, float]:
    """(seconds of the reference step outside its matmuls, attention, fixed per-layer costs and the
    optimizer update, may be negative; the step's seconds; the activation bytes it saves)."""
    from tessera.models import model_config
    from tessera.planner.catalog import from_model_config
    from tessera.planner.cpu_compute import activation_bytes_per_step
    from tessera.planner.flops import attention_flops as attention, model_flops
    from tessera.planner.layout import Layout
    from tessera.planner.memory import model_state_bytes

    preset, rows, seq = REFERENCE
    cfg = model_config(preset)
    spec = from_model_config(preset, cfg)
    measured = cfg.flops_per_token(seq) * rows * seq / step_flops_alone  # the step's seconds
    update = 2 * model_state_bytes(spec.num_params(), zero_stage=0, dp=1, precision="fp32")["total"]
    attn = attention(spec, rows * seq, seq)
    rest = (measured - (model_flops(spec, rows * seq, seq) - attn) / matmul_flops
            - attn / (attention_rate or matmul_flops) - attention_row_s * rows * seq * spec.heads * spec.layers
            - update / hbm_bytes_per_s - layer_call_s * (spec.layers + 1))
    return rest, measured, activation_bytes_per_step(spec, Layout(micro_batch=rows), rows, seq, precision="fp32")


def elementwise_seconds_per_byte(step_flops_alone: float, matmul_flops: float, hbm_bytes_per_s: float,
                                 layer_call_s: float = 0.0, attention_rate: float = 0.0,
                                 attention_row_s: float = 0.0) -> float:
    """Seconds the reference step spends outside its matmuls and the optimizer's memory-bound update,
    per byte of activations it saves (planner.cpu_compute.activation_bytes_per_step): the non-matmul
    kernels (norms, RoPE, SwiGLU, softmax, residual adds, the loss) write and read back about what they
    save, so the time model charges them by those bytes."""
    rest, _, acts = _rest(step_flops_alone, matmul_flops, hbm_bytes_per_s, layer_call_s, attention_rate,
                          attention_row_s)
    return max(0.0, rest) / acts


def _rates_args(r: dict) -> tuple:
    return (r["step_flops_alone"], r["peak_flops"], r["hbm_bytes_per_s"], r["layer_call_s"], r["attention_rate"],
            r.get("attention_row_s", 0.0))


def elementwise_from_rounds(at_one_speed: dict, per_round: list[dict]) -> float:
    """:func:`elementwise_seconds_per_byte` from rates timed in rounds (reference_step.rates): the rest
    as a share of each round's own step (its pieces timed within a second of each other, at one speed of
    a shared machine), the median share over rounds, of ``at_one_speed``'s step (the fastest). A
    difference of the fastest passes instead mixes passes made at different speeds: on a busy machine it
    came out 0 as often as not."""
    share = statistics.median_high(rest / step for rest, step, _ in (_rest(*_rates_args(r)) for r in per_round))
    _, step, acts = _rest(*_rates_args(at_one_speed))
    return max(0.0, share) * step / acts


def calibrate(world: int = 2) -> dict:
    """This machine's numbers in the form ``planner.local.local_gpu`` takes: ``peak_flops`` (the
    reference layer's matmuls), ``step_flops_alone`` (a reference training step in one process) and
    ``step_flops`` (the same on all ``world`` ranks at once: ``step_flops_alone`` times
    ``shared_core_efficiency``, how much ranks sharing the machine slow each other),
    ``half_flops`` (the same matmuls in bf16, for mixed-precision layouts),
    ``elementwise_s_per_byte`` (the step's time outside matmuls per activation byte), ``alpha_s`` and
    ``bytes_per_s`` (gloo ring all-reduce on ``world`` ranks, back to back), ``attention_rate`` (FLOP/s of
    the reference layer's causal attention, forward and backward) and ``attention_row_s`` (its cost per
    token and head beyond those FLOPs: reference_step.attention_fit), ``ring_forward_s`` and
    ``ring_backward_s`` (ring attention's seconds per score beyond its FLOPs: reference_step.ring_rates),
    ``hbm_bytes_per_s`` (the optimizer update's bytes per second, reference_step.update),
    ``collective_sync_s`` (what an all-reduce between compute segments costs beyond its α–β time) and
    ``layer_call_s`` (a layer's fixed cost per micro-batch)."""
    from tessera.planner.comm_model import Link, all_reduce_s

    start = time.perf_counter()
    single, per_round = ref.rates()  # the reference step's pieces, timed in the same rounds
    peak, attn, alone = single["peak_flops"], single["attention_rate"], single["step_flops_alone"]
    calls, hbm = single["layer_call_s"], single["hbm_bytes_per_s"]
    half = half_matmul_flops(peak)
    alpha, beta, rows, shared, interleaved = allreduce_alpha_beta(world)
    sync = max(0.0, interleaved - all_reduce_s(SYNC_BYTES, world, Link(alpha, beta)))
    return {"peak_flops": peak, "half_flops": half, "step_flops": alone * shared, "step_flops_alone": alone,
            "shared_core_efficiency": shared, "alpha_s": alpha,
            "bytes_per_s": beta, "collective_sync_s": sync, "hbm_bytes_per_s": hbm,
            "interleaved_allreduce_s": interleaved,  # negative: the machine was too busy to see the start-up
            "elementwise_s_per_byte": elementwise_from_rounds(single, per_round),
            "layer_call_s": calls, "attention_rate": attn, "attention_row_s": single["attention_row_s"],
            "ring_forward_s": single["ring_forward_s"], "ring_backward_s": single["ring_backward_s"],
            "ranks": world, "cores": os.cpu_count() or 1,
            "allreduce_samples": [{"bytes": s, "seconds": t} for s, t in rows],
            "seconds_taken": time.perf_counter() - start}
