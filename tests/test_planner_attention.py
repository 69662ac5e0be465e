"""The CPU time model charges attention's score and value matmuls at their own calibrated rate (tier 1:
pure): a calibration on one sequence length then carries over to others, where attention's share of the
step differs (its FLOPs grow with s² per sequence, the layer matmuls' with s)."""

import dataclasses

import pytest

from tessera.models.config import model_config
from tessera.planner import Layout, estimate, from_model_config
from tessera.planner.calibrate import REFERENCE, elementwise_seconds_per_byte
from tessera.planner.flops import attention_flops, model_flops
from tessera.planner.local import local_gpu

SMALL = from_model_config("small", model_config("small"))
CAL = {"peak_flops": 1e11, "step_flops": 8e10, "step_flops_alone": 8e10, "alpha_s": 1e-4, "bytes_per_s": 3e9,
       "layer_call_s": 1e-3, "ranks": 2, "cores": 2, "hbm_bytes_per_s": 1e10}


def test_attention_flops_is_the_attention_term_of_model_flops():
    tokens, seq = 512, 128
    without = model_flops(SMALL, tokens, 0)  # seq = 0 drops exactly the attention term
    assert attention_flops(SMALL, tokens, seq) == pytest.approx(model_flops(SMALL, tokens, seq) - without)
    selective = attention_flops(SMALL, tokens, seq, "selective")
    assert selective == pytest.approx(16 / 12 * attention_flops(SMALL, tokens, seq))


def test_no_attention_rate_means_peak_and_a_slower_rate_adds_exactly_its_seconds():
    layout, batch, seq = Layout(tp=2, micro_batch=4), 4, 256
    base = estimate(SMALL, layout, local_gpu(2, CAL), batch, seq, precision="fp32", optimizer="adam")
    same = estimate(SMALL, layout, local_gpu(2, {**CAL, "attention_rate": CAL["peak_flops"]}), batch, seq,
                    precision="fp32", optimizer="adam")
    assert same.time_s["compute"] == pytest.approx(base.time_s["compute"])
    gpu = local_gpu(2, {**CAL, "attention_rate": CAL["peak_flops"] / 2})
    slow = estimate(SMALL, layout, gpu, batch, seq, precision="fp32", optimizer="adam")
    extra = attention_flops(SMALL, batch * seq, seq) / layout.world / CAL["peak_flops"] / gpu.compute_efficiency
    assert slow.time_s["compute"] - base.time_s["compute"] == pytest.approx(extra)


def test_the_calibration_step_is_reproduced_whatever_the_attention_rate():
    # the non-matmul rate is what the reference step leaves after its matmuls: a slower attention leaves
    # less, so the one-process reference step's predicted time stays the measured one
    preset, rows, seq = REFERENCE
    cfg = model_config(preset)
    measured = cfg.flops_per_token(seq) * rows * seq / CAL["step_flops_alone"]
    for rate, row in ((0.0, 0.0), (6e10, 0.0), (8e10, 3e-7)):
        cal = {**CAL, "attention_rate": rate, "attention_row_s": row,
               "elementwise_s_per_byte": elementwise_seconds_per_byte(
                   CAL["step_flops_alone"], CAL["peak_flops"], CAL["hbm_bytes_per_s"], CAL["layer_call_s"], rate, row)}
        assert cal["elementwise_s_per_byte"] > 0
        est = estimate(SMALL, Layout(micro_batch=rows), local_gpu(1, cal), rows, seq, precision="fp32",
                       optimizer="adam")
        assert est.step_time_s == pytest.approx(measured, rel=1e-9)


def test_a_per_row_cost_adds_its_seconds_per_token_head_and_layer_and_reruns_with_the_forward():
    layout, batch, seq = Layout(tp=2, micro_batch=4), 4, 256
    cal = {**CAL, "attention_rate": 5e10}
    base = estimate(SMALL, layout, local_gpu(2, cal), batch, seq, precision="fp32", optimizer="adam")
    gpu = local_gpu(2, {**cal, "attention_row_s": 1e-6})
    rows = estimate(SMALL, layout, gpu, batch, seq, precision="fp32", optimizer="adam")
    extra = 1e-6 * batch * seq * SMALL.heads * SMALL.layers / layout.world / gpu.compute_efficiency
    assert rows.time_s["compute"] - base.time_s["compute"] == pytest.approx(extra)
    selective = dataclasses.replace(layout, recompute="selective")  # re-runs attention's forward: 16/12
    a, b = (estimate(SMALL, selective, local_gpu(2, c), batch, seq, precision="fp32", optimizer="adam")
            for c in (cal, {**cal, "attention_row_s": 1e-6}))
    assert b.time_s["compute"] - a.time_s["compute"] == pytest.approx(extra * 16 / 12)


def test_passes_at_several_sequence_lengths_give_the_rate_and_the_per_row_cost():
    from tessera.planner.reference_step import ATTENTION_LENGTHS, attention_fit

    cfg = model_config(REFERENCE[0])

    def passes(rate, row, noise=(1.0, 1.0, 1.0)):  # the calibration's passes on a machine of that rate
        return [(b, s, (12.0 * cfg.head_dim * s / rate + row) * b * s * cfg.n_heads * k)
                for (b, s), k in zip(ATTENTION_LENGTHS, noise)]

    rate, row = attention_fit(passes(5e10, 6e-7))
    assert rate == pytest.approx(5e10) and row == pytest.approx(6e-7)
    # a longer sequence no dearer per token (disturbed passes): FLOPs alone, at their mean rate
    flat = attention_fit(passes(5e10, 6e-7, noise=(2.5, 1.0, 0.4)))
    assert flat[1] == 0.0 and 1e10 < flat[0] < 5e10
    # no per-row cost at all, measured a little low at the shortest length: the line through 0, not below it
    rate, row = attention_fit(passes(5e10, 0.0, noise=(0.9, 1.0, 1.0)))
    assert row == 0.0 and rate == pytest.approx(5e10, rel=0.05)
