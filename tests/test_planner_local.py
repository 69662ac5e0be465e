"""The planner's accounting checked against what tessera's strategies do on local ranks (tier 1: pure):
pipeline stages' in-flight micro-batches, per-axis communication bytes of pipeline, context and expert
parallelism, offload's host copy, and the CPU time model (non-matmul kernels, per-collective start-up)."""

import pytest

from tessera.models.config import model_config
from tessera.planner import Layout, estimate, from_model_config, inflight_microbatches
from tessera.planner.calibrate import REFERENCE, elementwise_seconds_per_byte
from tessera.planner.cpu_compute import activation_bytes_per_step
from tessera.planner.estimate import comm_bytes
from tessera.planner.flops import model_flops
from tessera.planner.local import local_gpu
from tessera.pipeline.schedules import build_compute
from tessera.planner.memory import last_stage_inflight, stage_inflight

SMALL = from_model_config("small", model_config("small"))


def test_last_stage_holds_one_microbatch_except_gpipe_and_interleaved_warmup():
    assert last_stage_inflight("gpipe", 4, 8) == 8
    assert last_stage_inflight("1f1b", 4, 8) == 1
    # ZB-H1's last stage holds back p - 1 weight gradients: p micro-batches wait for their W
    assert last_stage_inflight("zb-h1", 4, 8) == 4 and last_stage_inflight("zb-h1", 4, 2) == 2
    # Megatron-LM's interleaved warm-up on rank r: 2(p − r − 1) + (v − 1)p forwards, then one more
    # before the first backward; in micro-batches through the whole stage (v chunks)
    for p, v in ((2, 2), (4, 2), (8, 3)):
        assert last_stage_inflight("interleaved", p, 64, v) == pytest.approx(((v - 1) * p + 1) / v)
        assert inflight_microbatches("interleaved", p, 64, v) == pytest.approx((2 * (p - 1) + (v - 1) * p + 1) / v)
    assert last_stage_inflight("interleaved", 2, 1, 2) == 1.0  # never more than the micro-batches there are


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_every_stage_holds_the_peak_of_tessera_schedules(schedule):
    # walk each rank's compute actions: a forward saves one chunk's activations, its backward (the W
    # when the backward is split) frees them; the peak over the step, in whole-stage micro-batches
    for pp in (2, 3, 4):
        for v in (1, 2, 3) if schedule == "interleaved" else (1,):
            for m in range(1, 9):
                if schedule == "interleaved" and m % pp:
                    continue  # the schedule refuses these
                actions, _, split = build_compute(schedule, pp, m, v)
                for stage, acts in enumerate(actions):
                    live = peak = 0
                    for a in acts:
                        live += (a.kind == "F") - (a.kind == ("W" if split else "B"))
                        peak = max(peak, live)
                    assert stage_inflight(stage, schedule, pp, m, v) == pytest.approx(peak / v), (pp, v, m, stage)
    with pytest.raises(ValueError):
        stage_inflight(2, schedule, 2, 4)


def test_pipeline_stage_memory_counts_the_logits_of_every_microbatch_in_flight():
    seq, m = 128, 4
    gpipe = estimate(SMALL, Layout(pp=2, schedule="gpipe", micro_batch=1), local_gpu(2), m, seq, "fp32")
    layer = estimate(SMALL, Layout(micro_batch=1), local_gpu(1), 1, seq, "fp32").memory_bytes["activations"]
    logits = seq * (3 * 4 * SMALL.hidden + 4 * SMALL.vocab)
    per_layer = (layer - logits) / SMALL.layers  # one sequence through one layer
    # both GPipe stages hold all m micro-batches of their 2 layers; the last also every logits tensor
    assert gpipe.memory_bytes["activations"] == pytest.approx(m * (2 * per_layer + logits))


def test_comm_bytes_of_pipeline_context_and_expert_parallelism():
    seq, m = 128, 4
    act = seq * SMALL.hidden * 4  # one micro-batch of one sequence, fp32
    # pp = 2: each rank sends (or receives) m activations and m gradients, counted at both ends
    assert comm_bytes(SMALL, Layout(pp=2, schedule="1f1b", micro_batch=1), m, seq, "fp32")["pp"] == 2 * m * act
    inter = Layout(pp=2, schedule="interleaved", virtual_stages=2, micro_batch=1)
    assert comm_bytes(SMALL, inter, m, seq, "fp32")["pp"] == 3 * 2 * m * act  # 3 boundaries among 4 chunks
    # ring attention, cp = 2: per layer the k/v block forward, again backward with its dk/dv accumulator
    # twice (cp shifts, fp32); sends and receives
    kv = 2 * 4 * (seq // 2) * SMALL.kv_heads * SMALL.head_dim * 4
    got = comm_bytes(SMALL, Layout(cp=2, micro_batch=4), 4, seq, "fp32")
    assert got["cp"] == SMALL.layers * 2 * (kv + kv + 2 * kv) and got["dp"] == SMALL.num_params() * 4
    moe = from_model_config("moe", model_config("moe-small"))
    ep = comm_bytes(moe, Layout(dp=2, ep=2, micro_batch=4), 8, seq, "fp32")
    assert ep["ep"] == 4 * (moe.layers // 2) * 4 * seq * 2 * moe.hidden * 4  # dispatch + combine, fwd + bwd
    # experts have no replica when ep = dp: only the dense gradients are all-reduced
    dense = moe.num_params() - moe.layers * moe.expert_layer_params()
    assert ep["dp"] == pytest.approx(dense * 4)


def test_offload_in_fp32_keeps_a_host_copy_of_the_parameter_shard():
    est = estimate(SMALL, Layout(dp=2, zero_stage=2, offload=True, micro_batch=4), local_gpu(2), 8, 128, "fp32")
    psi = SMALL.num_params()
    assert est.memory_bytes["optimizer"] == 0
    assert est.host_bytes == pytest.approx((8 + 4) * psi / 2)
    mixed = estimate(SMALL, Layout(dp=2, zero_stage=2, offload=True, micro_batch=4), local_gpu(2), 8, 128, "mixed")
    # the master copy is among the 12 bytes already; + the fp32 copy of the gradient slice the update reads
    assert mixed.host_bytes == pytest.approx((12 + 4) * psi / 2)


def test_moe_layers_save_k_expert_rows_instead_of_one_dense_ffn():
    moe = from_model_config("moe", model_config("moe-small"))
    dense = from_model_config("dense", model_config("moe-small", num_experts=0))
    lay = Layout(dp=2, ep=2, micro_batch=4)
    a_moe = estimate(moe, lay, local_gpu(2), 8, 128, "fp32").memory_bytes["activations"]
    a_dense = estimate(dense, Layout(dp=2, micro_batch=4), local_gpu(2), 8, 128, "fp32").memory_bytes["activations"]
    per_token = 4 * (2 * (4 * moe.ffn + 2 * moe.hidden) - 4 * moe.ffn) + 4 * 3 * moe.experts
    assert a_moe - a_dense == pytest.approx(2 * 4 * 128 * per_token)  # 2 MoE layers, 512 tokens


def test_calibrated_model_reproduces_the_reference_step_and_charges_tp_its_replicated_kernels():
    preset, rows, seq = REFERENCE
    cfg = model_config(preset)
    flops = cfg.flops_per_token(seq) * rows * seq
    cal = {"peak_flops": 4e10, "step_flops_alone": 2.5e10, "step_flops": 2e10, "alpha_s": 1e-4,
           "bytes_per_s": 1e9, "collective_sync_s": 1e-3, "hbm_bytes_per_s": 1e10, "ranks": 2, "cores": 2,
           "layer_call_s": 2e-3}
    cal["elementwise_s_per_byte"] = elementwise_seconds_per_byte(cal["step_flops_alone"], cal["peak_flops"], 1e10,
                                                                 cal["layer_call_s"])
    single = estimate(SMALL, Layout(micro_batch=rows), local_gpu(1, cal), rows, seq, "fp32")
    assert single.step_time_s == pytest.approx(flops / cal["step_flops_alone"])
    # two ranks at once run at step_flops / step_flops_alone of the speed alone
    two = local_gpu(2, cal)
    assert two.compute_efficiency == pytest.approx(0.8) and two.collective_sync_s == 1e-3
    tp = estimate(SMALL, Layout(tp=2, micro_batch=rows), two, rows, seq, "fp32")
    acts_tp = activation_bytes_per_step(SMALL, Layout(tp=2, micro_batch=rows), rows, seq, "fp32")
    acts_1 = activation_bytes_per_step(SMALL, Layout(micro_batch=rows), rows, seq, "fp32")
    assert 0.5 < acts_tp / acts_1 < 0.7  # the residual stream's norms and adds are not split
    charged = model_flops(SMALL, rows * seq, seq)  # the planner's count (ModelConfig's differs by 0.05%)
    calls = 2e-3 * (SMALL.layers + 1)  # a TP rank runs every layer's kernels, however narrow
    assert tp.time_s["compute"] == pytest.approx(
        (charged / 2 / 4e10 + cal["elementwise_s_per_byte"] * acts_tp + calls) / 0.8)
    # four micro-batches of one sequence pay each layer's fixed cost four times
    split = estimate(SMALL, Layout(micro_batch=1), local_gpu(1, cal), rows, seq, "fp32")
    assert split.time_s["compute"] - single.time_s["compute"] == pytest.approx(3 * calls)
    # 4 collectives per layer, 2 around the layers, 3 loss reductions: each pays the start-up once
    no_sync = estimate(SMALL, Layout(tp=2, micro_batch=rows), local_gpu(2, {**cal, "collective_sync_s": 0.0}),
                       rows, seq, "fp32")
    assert tp.time_s["tp"] - no_sync.time_s["tp"] == pytest.approx((4 * SMALL.layers + 2 + 3) * 1e-3)


def test_recomputation_saves_memory_but_reruns_the_forward_kernels():
    cal = {"peak_flops": 4e10, "step_flops_alone": 2.5e10, "step_flops": 2.5e10, "alpha_s": 1e-4,
           "bytes_per_s": 1e9, "hbm_bytes_per_s": 1e10, "elementwise_s_per_byte": 1e-9}
    gpu = local_gpu(1, cal)
    none, full = (estimate(SMALL, Layout(micro_batch=4, recompute=r), gpu, 4, 128, "fp32") for r in ("none", "full"))
    assert full.memory_bytes["activations"] < none.memory_bytes["activations"] / 4
    acts = activation_bytes_per_step(SMALL, Layout(micro_batch=4), 4, 128, "fp32")
    extra_flops = full.time_s["compute"] - none.time_s["compute"] - 1e-9 * acts / 3
    assert extra_flops == pytest.approx((2 * (SMALL.matmul_params_per_token() - SMALL.vocab * SMALL.hidden)
                                         + 4 * SMALL.layers * SMALL.hidden * 128) * 512 / 4e10)


def test_mixed_precision_matmuls_run_at_the_calibrated_bf16_rate():
    # an AVX2 CPU runs bf16 products through torch's reference kernel, ~50x slower than fp32: a planner
    # that charged mixed precision at the fp32 rate would pick it (half the activation bytes) as faster
    cal = {"peak_flops": 4e10, "step_flops_alone": 2.5e10, "step_flops": 2.5e10, "alpha_s": 1e-4,
           "bytes_per_s": 1e9, "hbm_bytes_per_s": 1e10, "elementwise_s_per_byte": 1e-9}
    layout = Layout(micro_batch=4)
    fp32_rate = estimate(SMALL, layout, local_gpu(1, cal), 4, 128, "mixed").time_s["compute"]
    slow = estimate(SMALL, layout, local_gpu(1, {**cal, "half_flops": 4e10 / 50}), 4, 128, "mixed")
    matmul_s = model_flops(SMALL, 512, 128) / 4e10
    assert slow.time_s["compute"] - fp32_rate == pytest.approx(49 * matmul_s)
    fp32 = estimate(SMALL, layout, local_gpu(1, {**cal, "half_flops": 4e10 / 50}), 4, 128, "fp32")
    assert fp32.step_time_s < slow.step_time_s / 10  # fp32 layouts are charged at peak_flops, as before


def test_calibration_measures_a_bf16_rate_of_the_same_products():
    from tessera.planner.calibrate import half_matmul_flops

    rate = half_matmul_flops(1e10, tokens=16, seconds=0.01)
    assert rate > 0 and rate != 1e10  # a measured ratio of two timings, not the fp32 rate handed in


def test_calibration_times_the_optimizer_update_instead_of_assuming_a_bandwidth():
    from tessera.planner.local import DEFAULT_LOCAL
    from tessera.planner.reference_step import fastest, one_thread, update

    with one_thread():
        run, moved = update()
        rate = moved / fastest({"update": run}, 0.0, 3)["update"]
    # a measured AdamW step over 32 bytes per parameter: positive, finite, and not the default it replaces
    assert 1e7 < rate < 1e13 and rate != DEFAULT_LOCAL["hbm_bytes_per_s"]


class _Clock:
    """A thread clock that moves only when ``run`` is called, by the next of ``durations``."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def thread_time(self):
        return self.now

    def run(self):
        self.now += self.durations.pop(0)
        self.calls += 1


@pytest.mark.parametrize("rank", [0, 1])
def test_shared_core_efficiency_pairs_each_together_step_with_an_alone_step_of_the_same_round(monkeypatch, rank):
    """Each round times one step with every rank busy, then one alone; the median per-round ratio ignores
    both the machine's drift between rounds (speeds ×0.5 to ×3) and one disturbed round."""
    from tessera.planner import calibrate

    speeds = [1.0, 1.0, 3.0, 1.0, 0.5, 1.0]
    durations = [d for k in speeds for d in (1.25 * k, 1.0 * k)] + [2.5, 1.0]  # last round: a busy spell
    clock, barriers = _Clock(durations), []
    monkeypatch.setattr(calibrate, "time", clock)
    got = calibrate.shared_core_efficiency(clock.run, rank, 2, lambda: barriers.append(1), rounds=7)
    assert got == pytest.approx(0.8)
    assert clock.calls == 14 and not clock.durations  # two steps a round on this rank: together, then alone
    assert len(barriers) == 7 * 3 + 1  # before the together step and before each rank's turn, and at the end


def test_calibrated_multi_rank_rate_is_the_one_process_rate_times_the_shared_core_efficiency():
    gpu1 = local_gpu(1, {"peak_flops": 9e10, "step_flops_alone": 6e10, "step_flops": 4.5e10,
                         "elementwise_s_per_byte": 1e-10})
    gpu2 = local_gpu(2, {"peak_flops": 9e10, "step_flops_alone": 6e10, "step_flops": 4.5e10,
                         "elementwise_s_per_byte": 1e-10, "cores": 2, "ranks": 2})
    assert gpu1.compute_efficiency == 1.0 and gpu2.compute_efficiency == pytest.approx(0.75)
