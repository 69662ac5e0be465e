"""The planner's formulas against the published numbers they come from (tier 1: pure, milliseconds).

ZeRO (Rajbhandari et al. 2019) model-state memory; Korthikanti et al. 2022 Table 2 activation memory;
Narayanan et al. 2021 eq. 3 FLOPs and the pipeline bubble; catalogue parameter counts against the
published model sizes; the Llama-layer count against what autograd really saves in tessera's model.
"""

import pytest
import torch

from tessera.models import Transformer, cross_entropy_sum
from tessera.models.config import model_config
from tessera.planner import (activation_bytes_per_layer, bubble_fraction, flops_per_iteration, get_model,
                             inflight_microbatches, llama_activation_bytes_per_layer, model_flops,
                             model_state_bytes)
from tessera.planner.memory import logits_bytes
from tessera.train.memory import MemoryLedger

GB = 1e9


# ---- ZeRO: model states per stage ---------------------------------------------------------------------

@pytest.mark.parametrize("stage, published_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_on_64_gpus(stage, published_gb):
    # ZeRO paper Figure 1: Ψ = 7.5B, N_d = 64, K = 12.
    got = model_state_bytes(7.5e9, zero_stage=stage, dp=64)["total"] / GB
    assert round(got, 1) == published_gb


def test_zero_16_bytes_per_parameter_and_what_each_stage_shards():
    base = model_state_bytes(1, zero_stage=0, dp=8)
    assert (base["params"], base["grads"], base["optimizer"], base["total"]) == (2, 2, 12, 16)
    s1, s2, s3 = (model_state_bytes(1, zero_stage=z, dp=8) for z in (1, 2, 3))
    assert (s1["params"], s1["grads"], s1["optimizer"]) == (2, 2, 1.5)
    assert (s2["params"], s2["grads"], s2["optimizer"]) == (2, 0.25, 1.5)
    assert s3["total"] == 2.0  # 16Ψ / N_d
    fp32 = model_state_bytes(1, zero_stage=0, dp=1, precision="fp32")
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4, 4, 8)
    assert model_state_bytes(1, zero_stage=0, dp=1, optimizer="sgd")["optimizer"] == 8
    with pytest.raises(ValueError):
        model_state_bytes(1, zero_stage=4, dp=8)


# ---- Korthikanti et al. 2022, Table 2 -----------------------------------------------------------------

S, B, H, A, T = 2048, 1, 12288, 96, 8  # GPT-3 175B, one sequence per micro-batch, t = 8


def test_activation_every_table_2_row():
    sbh = S * B * H
    assert 5 * A * S / H == 80  # the paper's "5as/h = 80 for GPT-3"
    rows = {
        ("none", 1, False): sbh * (34 + 80),
        ("none", T, False): sbh * (10 + 24 / T + 80 / T),
        ("none", T, True): sbh / T * (34 + 80),
        ("selective", T, False): sbh * (10 + 24 / T),
        ("selective", T, True): sbh * 34 / T,
        ("full", T, True): 2 * sbh,
        ("full", 1, False): 2 * sbh,
    }
    for (rc, t, sp), want in rows.items():
        got = activation_bytes_per_layer(S, B, H, A, tp=t, sequence_parallel=sp, recompute=rc)
        assert got == pytest.approx(want, rel=1e-12), (rc, t, sp)
    assert activation_bytes_per_layer(S, B, H, A) == 2048 * 12288 * 114  # 2.87 GB per layer, no TP


def test_sequence_parallel_plus_selective_saves_about_5x():
    # Korthikanti et al.: together the two techniques cut activation memory by about 5x vs TP alone.
    tp_only = activation_bytes_per_layer(S, B, H, A, tp=T)
    both = activation_bytes_per_layer(S, B, H, A, tp=T, sequence_parallel=True, recompute="selective")
    assert 5 <= tp_only / both < 6


def test_pipeline_micro_batches_in_flight():
    # 1F1B's first stage holds p micro-batches, so p stages × L/p layers = L layers' worth (Korthikanti §4.2.3)
    assert inflight_microbatches("1f1b", 8, 64) == 8
    assert inflight_microbatches("zb-h1", 8, 64) == 8
    assert inflight_microbatches("gpipe", 8, 64) == 64
    assert inflight_microbatches("interleaved", 8, 64, 2) == pytest.approx(8 * (1 + 7 / 16))
    assert inflight_microbatches("1f1b", 8, 4) == 4 and inflight_microbatches("none", 1, 64) == 1


def _measured_activations(preset, layers, kv_heads, b, s):
    cfg = model_config(preset, n_layers=layers, n_kv_heads=kv_heads)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ledger = MemoryLedger(model)
    x = torch.randint(0, cfg.vocab_size, (b, s))
    with ledger.track_activations():
        cross_entropy_sum(model(x), x)
    return ledger.activation_bytes, cfg


@pytest.mark.parametrize("preset, layers, kv_heads, b, s", [("tiny", 2, 2, 2, 32), ("small", 2, 8, 2, 64),
                                                            ("small", 4, 4, 4, 32)])
def test_llama_layer_count_matches_what_autograd_saves(preset, layers, kv_heads, b, s):
    measured, cfg = _measured_activations(preset, layers, kv_heads, b, s)
    layer = llama_activation_bytes_per_layer(s, b, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden_dim,
                                             elem_bytes=4)
    predicted = layers * layer + logits_bytes(s, b, cfg.dim, cfg.vocab_size, elem_bytes=4)
    assert predicted == pytest.approx(measured, rel=0.03)


# ---- Narayanan et al. 2021: FLOPs (eq. 3) and the bubble -----------------------------------------------

def test_eq3_gpt3_175b_training_time_worked_example():
    # §5.1: 175B, batch 1536, 1024 GPUs at 140 TFLOP/s each, 300B tokens: "about 34 days" (their 8TP/nX).
    per_iter = flops_per_iteration(1536, 2048, 96, 12288, 51200)
    days = per_iter * 300e9 / (1536 * 2048) / (1024 * 140e12) / 86400
    assert 33.5 < days < 35.5
    assert per_iter / (1536 * 2048) == pytest.approx(8 * 175e9, rel=0.03)  # ≈ 8·P FLOPs per token


def test_eq3_recompute_adds_a_forward():
    with_rc = flops_per_iteration(8, 1024, 24, 2048, 0, recompute=True)
    without = flops_per_iteration(8, 1024, 24, 2048, 0, recompute=False)
    assert with_rc / without == pytest.approx(96 / 72)
    # the logit layer is not recomputed: its term (6·B·s·h·V) is the same in both
    v_with = flops_per_iteration(8, 1024, 24, 2048, 50000) - with_rc
    v_without = flops_per_iteration(8, 1024, 24, 2048, 50000, recompute=False) - without
    assert v_with == pytest.approx(v_without) == pytest.approx(6 * 8 * 1024 * 2048 * 50000)


def test_model_flops_of_a_gpt_equals_eq3_without_recompute():
    spec = get_model("gpt3-13b")
    want = flops_per_iteration(64, 2048, spec.layers, spec.hidden, spec.vocab, recompute=False)
    assert model_flops(spec, 64 * 2048, 2048) == pytest.approx(want, rel=1e-3)  # biases and norms only


@pytest.mark.parametrize("p, m", [(4, 8), (8, 32), (16, 64), (2, 2)])
def test_bubble_fractions(p, m):
    # Narayanan et al.: bubble time / ideal time = (p-1)/m; as a share of the whole step (p-1)/(m+p-1).
    b = bubble_fraction("1f1b", p, m)
    assert b == pytest.approx((p - 1) / (m + p - 1))
    assert b / (1 - b) == pytest.approx((p - 1) / m)
    assert bubble_fraction("gpipe", p, m) == b
    inter = bubble_fraction("interleaved", p, m, virtual_stages=2)
    assert inter / (1 - inter) == pytest.approx((p - 1) / (2 * m))  # divided by v
    zb = bubble_fraction("zb-h1", p, m)
    assert zb / (1 - zb) == pytest.approx(b / (1 - b) / 3)  # ZB-H1: about a third of 1F1B's
    assert bubble_fraction("1f1b", 1, m) == 0.0
    with pytest.raises(ValueError):
        bubble_fraction("pipedream", p, m)


# ---- catalogue ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, published_b", [("gpt3-175b", 175.0), ("gpt3-13b", 13.0), ("gpt3-6.7b", 6.7),
                                               ("llama2-7b", 6.74), ("llama2-70b", 68.98), ("llama3-8b", 8.03),
                                               ("llama3-70b", 70.55), ("llama3-405b", 405.85)])
def test_catalogue_parameter_counts(name, published_b):
    assert get_model(name).num_params() / 1e9 == pytest.approx(published_b, rel=0.015)


def test_reference_presets_count_like_the_model():
    cfg = model_config("small")
    spec = get_model("tessera-small")
    assert spec.num_params() == sum(p.numel() for p in Transformer(cfg).parameters())
    # models.config counts the norm weights in its 6·N too; the planner leaves them out (no matmul)
    planner = spec.matmul_params_per_token() * 6 + 12 * spec.layers * spec.hidden * 128
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    assert planner + 6 * norms == cfg.flops_per_token(128)
