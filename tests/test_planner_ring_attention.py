"""A calibrated CPU charges ring attention (cp > 1) by the query-key scores each rank's blocks compute,
not as one fused SDPA (tier 1: pure): the blocks materialize their scores in float32 and run softmax,
masking and the online merge as separate kernels, about twice the fused kernel's time per score."""

import dataclasses

import pytest

from tessera.context_parallel.ring_attention import _regions
from tessera.models.config import model_config
from tessera.planner import Layout, estimate, from_model_config
from tessera.planner.cpu_compute import ring_attention_s, sdpa_s
from tessera.planner.flops import ring_scores
from tessera.planner.local import local_gpu
from tessera.planner.reference_step import ring_rates

SMALL = from_model_config("small", model_config("small"))
CAL = {"peak_flops": 1e11, "step_flops": 8e10, "step_flops_alone": 8e10, "alpha_s": 1e-4, "bytes_per_s": 3e9,
       "layer_call_s": 1e-3, "ranks": 2, "cores": 2, "hbm_bytes_per_s": 1e10, "attention_rate": 5e10,
       "attention_row_s": 5e-7}
RING = {"ring_forward_s": 2e-8, "ring_backward_s": 3e-8}


def _span(s: slice, n: int) -> int:
    return len(range(n)[s])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_score_count_is_what_every_rank_computes_on_its_zig_zag_blocks(cp):
    rows, heads, seq = 2, 3, 16 * cp
    local, c = seq // cp, seq // cp // 2
    for rank in range(cp):
        scores = 0
        for step in range(cp):
            qs, ks, _ = _regions(step, rank, cp, c)
            scores += _span(qs, local) * _span(ks, local)
        assert rows * heads * scores == ring_scores(rows, heads, seq, cp)


def test_per_score_seconds_are_what_the_blocks_take_beyond_their_flops():
    e, rate, scores = 32, 4e10, 1e6
    fwd, bwd = (scores * (k * e / rate + extra) for k, extra in ((4, 3e-8), (10, 5e-8)))
    assert ring_rates(fwd, bwd, scores, e, rate) == pytest.approx((3e-8, 5e-8))
    assert ring_rates(fwd / 100, bwd / 100, scores, e, rate) == (0.0, 0.0)  # faster than the FLOPs allow


def test_a_cp_layout_trades_the_sdpa_charge_for_the_rings_scores():
    layout, batch, seq = Layout(cp=2, micro_batch=4), 4, 256
    sdpa_only = estimate(SMALL, layout, local_gpu(2, CAL), batch, seq, precision="fp32", optimizer="adam")
    gpu = local_gpu(2, {**CAL, **RING})
    ring = estimate(SMALL, layout, gpu, batch, seq, precision="fp32", optimizer="adam")
    change = (ring_attention_s(SMALL, layout, gpu, batch, seq)
              - sdpa_s(SMALL, gpu, batch * seq, seq, "none") / layout.world) / gpu.compute_efficiency
    assert ring.time_s["compute"] - sdpa_only.time_s["compute"] == pytest.approx(change)
    # per layer and micro-batch: 4 × 8 heads × (128² + 128·64) scores, 14e FLOPs + both per-score costs
    per_score = 14 * SMALL.head_dim / CAL["attention_rate"] + sum(RING.values())
    assert ring_attention_s(SMALL, layout, gpu, batch, seq) == pytest.approx(
        SMALL.layers * 4 * 8 * (128 * 128 + 128 * 64) * per_score)
    # one rank: no ring, the calibration's ring numbers change nothing
    single = Layout(micro_batch=4)
    a, b = (estimate(SMALL, single, local_gpu(1, c), batch, seq, precision="fp32", optimizer="adam")
            for c in (CAL, {**CAL, **RING}))
    assert a.step_time_s == b.step_time_s


def test_recomputation_reruns_the_rings_forward_and_tensor_parallelism_splits_its_heads():
    gpu = local_gpu(4, {**CAL, **RING})
    layout, batch, seq = Layout(cp=2, micro_batch=2), 4, 128
    base = ring_attention_s(SMALL, layout, gpu, batch, seq)
    again = ring_attention_s(SMALL, dataclasses.replace(layout, recompute="selective"), gpu, batch, seq)
    forward = ring_scores(2, SMALL.heads, seq, 2) * SMALL.layers * 2 * (
        4 * SMALL.head_dim / CAL["attention_rate"] + RING["ring_forward_s"])
    assert again - base == pytest.approx(forward)
    tp = ring_attention_s(SMALL, dataclasses.replace(layout, tp=2), gpu, batch, seq)
    assert tp == pytest.approx(base / 2)
