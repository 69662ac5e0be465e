"""tessera's pipeline schedules against torch.distributed.pipelining's, as benchmarks/pipeline.py pairs them:
on the same stage modules, batch and loss, each pair computes the same losses and gradients step after step
(the benchmark's like-for-like claim, zero-bubble with one stage per rank included), on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tessera.topology import ParallelConfig, Topology

_SPEC = importlib.util.spec_from_file_location(
    "bench_pipeline", Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

BATCH, SEQ, M, LAYERS, STEPS = 4, 16, 2, 4, 2


def _pairs_worker(rank, world_size):
    """Per pair and step: ((tessera loss, tessera squared grad norm), (torch's, torch's)) on this rank."""
    import _common

    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=120))
    try:
        x, y = _common.token_batch(0, BATCH, SEQ)
        out = {}
        for ours, v, theirs in bench.PAIRS:
            a, b = bench._pair_runners(ours, v, theirs, topo.group("pp"), rank, world_size, "tiny", LAYERS, x, y, M)
            out[ours] = [(a(probe=True), b(probe=True)) for _ in range(STEPS)]  # step 2 runs on updated weights
        return out
    finally:
        topo.destroy()


def test_pipeline_schedules_match_torch_pipelining(rank_pool):
    res = rank_pool.run(_pairs_worker, 2)
    assert [ours for ours, _, _ in bench.PAIRS] == ["gpipe", "1f1b", "interleaved", "zb-h1"]
    assert ("zb-h1", 1, "ScheduleInterleavedZeroBubble") in bench.PAIRS  # like for like: v = 1 on both sides
    for ours, _, _ in bench.PAIRS:
        for rank, per_rank in enumerate(res):
            for step, ((loss_a, grad_a), (loss_b, grad_b)) in enumerate(per_rank[ours]):
                where = f"{ours} rank {rank} step {step}"
                assert (loss_a is None) == (loss_b is None) == (rank != 1), where  # on the last stage's rank
                if loss_a is not None:
                    assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_b), where
                assert grad_a > 0 and abs(grad_a - grad_b) <= 1e-5 * grad_b, where
        assert res[1][ours][1][0][0] < res[1][ours][0][0][0]  # the update lowered the loss on this batch
