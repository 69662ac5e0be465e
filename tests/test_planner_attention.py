"""The CPU time model charges attention's score and value matmuls at their own calibrated rate (tier 1:
pure): a calibration on one sequence length then carries over to others, where attention's share of the
step differs (its FLOPs grow with s² per sequence, the layer matmuls' with s)."""

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
    for rate in (0.0, 6e10):
        cal = {**CAL, "attention_rate": rate, "elementwise_s_per_byte": elementwise_seconds_per_byte(
            CAL["step_flops_alone"], CAL["peak_flops"], CAL["hbm_bytes_per_s"], CAL["layer_call_s"], rate)}
        est = estimate(SMALL, Layout(micro_batch=rows), local_gpu(1, cal), rows, seq, precision="fp32",
                       optimizer="adam")
        assert est.step_time_s == pytest.approx(measured, rel=1e-9)
