"""The planner's time model, search, `tessera plan` CLI and the local-layout chooser (tier 1: pure)."""

import json

import pytest

from tessera.cli import main
from tessera.errors import ConfigError
from tessera.models.config import model_config
from tessera.planner import (Layout, NoLayoutFits, SearchSpace, choose_local_layout, enumerate_layouts,
                             estimate, get_gpu, get_model, search)
from tessera.planner import comm_model as cm
from tessera.planner.calibrate import fit_alpha_beta


def test_alpha_beta_ring_formulas_and_link_tiers():
    link = cm.Link(alpha_s=1e-5, bytes_per_s=1e9)
    assert cm.all_reduce_s(8e9, 8, link) == pytest.approx(14 * 1e-5 + 2 * 7 / 8 * 8.0)
    assert cm.all_gather_s(8e9, 8, link) == pytest.approx(7 * 1e-5 + 7 / 8 * 8.0)
    assert cm.all_reduce_s(8e9, 1, link) == 0.0
    gpu = get_gpu("h100")
    links = cm.axis_links(gpu, Layout(dp=4, tp=8, pp=2))
    nccl = gpu.nccl_efficiency  # the bus bandwidth NCCL reaches of each link
    assert 0 < nccl < 1
    assert links["tp"].bytes_per_s == gpu.intra_bytes_per_s * nccl  # tp peers share a node
    assert links["dp"].bytes_per_s == gpu.inter_bytes_per_s * nccl  # dp peers are 8 ranks apart
    assert cm.axis_links(gpu, Layout(dp=4, tp=2))["dp"].bytes_per_s == gpu.intra_bytes_per_s * nccl


def test_calibration_fit_recovers_alpha_and_beta():
    alpha, beta = 2e-4, 1.5e9
    rows = [(s, 2 * alpha + s / beta) for s in (4096, 2**18, 2**22, 2**24)]
    got_a, got_b = fit_alpha_beta(rows, world=2)
    assert got_a == pytest.approx(alpha, rel=1e-6) and got_b == pytest.approx(beta, rel=1e-6)


def test_estimate_parts_add_up_and_respond_to_the_layout():
    spec, gpu = get_model("llama3-8b"), get_gpu("h100")
    base = estimate(spec, Layout(dp=8, micro_batch=1), gpu, global_batch=64, seq=4096)
    assert sum(base.time_s.values()) == pytest.approx(base.step_time_s)
    assert base.tokens_per_s == pytest.approx(64 * 4096 / base.step_time_s)
    assert 0 < base.mfu < 1 and base.bubble_fraction == 0
    mem = base.memory_bytes
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    # ZeRO-3 shards everything: 16Ψ/8 of model states
    z3 = estimate(spec, Layout(dp=8, zero_stage=3), gpu, 64, 4096)
    states = z3.memory_bytes["params"] + z3.memory_bytes["grads"] + z3.memory_bytes["optimizer"]
    assert states == pytest.approx(16 * spec.num_params() / 8, rel=1e-9)
    # offload moves the optimizer states to the host and costs time
    off = estimate(spec, Layout(dp=8, zero_stage=2, offload=True), gpu, 64, 4096)
    # (12 bytes of states, and the fp32 copy of the gradient slice the host's update reads)
    assert off.memory_bytes["optimizer"] == 0 and off.host_bytes == pytest.approx((12 + 4) * spec.num_params() / 8)
    assert off.time_s["offload"] > 0
    # recomputation trades memory for compute; pipelining adds a bubble
    full = estimate(spec, Layout(dp=8, recompute="full"), gpu, 64, 4096)
    assert full.memory_bytes["activations"] < base.memory_bytes["activations"] / 5  # logits stay
    assert full.time_s["compute"] > base.time_s["compute"] * 1.25
    pipe = estimate(spec, Layout(dp=2, pp=4, schedule="1f1b"), gpu, 64, 4096)
    assert pipe.bubble_fraction == pytest.approx(3 / (32 + 3)) and pipe.time_s["bubble"] > 0


def test_search_returns_only_fitting_layouts_fastest_first():
    spec, gpu = get_model("llama2-7b"), get_gpu("a100-40gb")
    plan = search(spec, gpu, 16, 64, 2048)
    assert plan.ranked and plan.considered > len(plan.ranked)
    times = [e.step_time_s for e in plan.ranked]
    assert times == sorted(times)
    limit = gpu.memory_bytes * gpu.usable_fraction
    assert all(e.memory_bytes["total"] <= limit and e.layout.world == 16 for e in plan.ranked)
    for e in plan.ranked:
        lay = e.layout
        assert 64 % (lay.dp * lay.micro_batch) == 0 and spec.heads % lay.tp == 0 and spec.layers % lay.pp == 0


def test_search_space_restrictions_are_honoured():
    spec = get_model("tessera-small")
    space = SearchSpace(tp=False, pp=False, cp=False, zero_stages=(0,), offload=False, recompute=("none",))
    layouts = list(enumerate_layouts(spec, 4, 16, 128, space=space))
    assert layouts and all(lay.tp == lay.pp == lay.cp == 1 and lay.zero_stage == 0 for lay in layouts)


def test_bad_requests_raise_one_sentence():
    spec, gpu = get_model("gpt3-125m"), get_gpu("a100-80gb")
    with pytest.raises(ConfigError, match="cannot be split over any layout of 1024 GPUs"):
        search(spec, gpu, 1024, 3)
    with pytest.raises(ConfigError, match="must be a positive integer"):
        search(spec, gpu, 0, 8)
    with pytest.raises(ConfigError, match="unknown model 'llama3-80b'"):
        get_model("llama3-80b")
    with pytest.raises(ConfigError, match="unknown GPU"):
        get_gpu("b200")
    with pytest.raises(NoLayoutFits, match=r"no layout fits: the smallest .* needs \d+\.\d GB per GPU"):
        search(get_model("gpt3-175b"), get_gpu("a100-40gb"), 8, 8)


def test_choose_local_layout_for_the_trainer():
    cfg = model_config("tiny")
    got = choose_local_layout(cfg, 2, global_batch=8, seq=32, strategies=("dp",))
    assert got["dp_replicate"] * got["dp_shard"] * got["pp"] * got["tp"] * got["cp"] == 2
    assert got["dp_replicate"] == 2 and got["zero_stage"] == 0 and got["step_time_s"] > 0
    got = choose_local_layout(cfg, 4, global_batch=8, seq=32, micro_batch=2)
    assert got["micro_batch_size"] == 2
    assert got["dp_replicate"] * got["dp_shard"] * got["pp"] * got["tp"] * got["cp"] == 4


def test_cli_plan_table_and_json(capsys):
    assert main(["plan", "--model", "llama2-7b", "--gpus", "16", "--gpu", "a100-80gb", "--global-batch", "32",
                 "--seq", "2048", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "llama2-7b" in out and "top choices:" in out and "MFU" in out
    assert main(["plan", "--model", "llama2-7b", "--gpus", "16", "--global-batch", "32", "--seq", "2048",
                 "--json", "--top", "2", "--set-gpu", "peak_flops=1e15"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["layouts"]) == 2
    first = data["layouts"][0]
    assert {"layout", "memory_bytes", "step_time_s", "tokens_per_s", "mfu", "bubble_fraction"} <= set(first)
    assert set(first["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}


@pytest.mark.parametrize("argv, code, message", [
    (["--model", "nope-7b"], 2, "unknown model 'nope-7b'"),
    (["--model", "llama3-8b", "--gpu", "tpu"], 2, "unknown GPU 'tpu'"),
    (["--model", "gpt3-125m", "--gpus", "1024", "--global-batch", "3"], 2, "cannot be split"),
    (["--model", "gpt3-175b", "--gpus", "8", "--gpu", "a100-40gb", "--global-batch", "8"], 1, "no layout fits"),
    (["--model", "llama3-8b", "--set-gpu", "colour=red"], 2, "unknown GPU field 'colour'"),
    (["--model", "llama3-8b", "--bogus"], 2, "does not take --bogus"),
])
def test_cli_plan_bad_input(capsys, argv, code, message):
    assert main(["plan", *argv]) == code
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_local_gpu_uses_the_calibrated_training_step_rate():
    from tessera.planner.local import local_gpu

    cal = {"peak_flops": 2e10, "step_flops": 5e9, "step_flops_alone": 1e10, "alpha_s": 3e-4, "bytes_per_s": 1e9}
    two, one = local_gpu(2, cal), local_gpu(1, cal)
    assert two.compute_efficiency == pytest.approx(0.25) and one.compute_efficiency == pytest.approx(0.5)
    assert two.intra_alpha_s == 3e-4 and two.gpus_per_node == 2
    spec = get_model("tessera-small")
    single = estimate(spec, Layout(dp=1, micro_batch=4), one, 4, 128, precision="fp32")
    flops = 4 * 128 * (6 * spec.matmul_params_per_token() + 12 * spec.layers * spec.hidden * 128)
    assert single.time_s["compute"] == pytest.approx(flops / 1e10)


def test_comm_bytes_per_step_follow_the_zero_accounting():
    from tessera.planner.estimate import comm_bytes

    spec = get_model("tessera-small")
    grad = spec.num_params() * 4
    ddp = comm_bytes(spec, Layout(dp=2, micro_batch=2), 8, 64, precision="fp32")
    assert ddp == {"dp": grad, "tp": 0.0, "pp": 0.0, "cp": 0.0, "ep": 0.0}
    assert comm_bytes(spec, Layout(dp=2, zero_stage=1, micro_batch=2), 8, 64, "fp32")["dp"] == 2 * grad
    # ZeRO-3 gathers twice and reduce-scatters once per micro-batch: 1.5x DDP's wire traffic per micro-batch,
    # less the second gather of the root unit (the final norm), which stays gathered forward to backward
    root = spec.hidden * 4
    assert comm_bytes(spec, Layout(dp=2, zero_stage=3, micro_batch=2), 8, 64, "fp32")["dp"] == (3 * grad - root) * 2
    tp, sp = (comm_bytes(spec, Layout(tp=2, sp=s, micro_batch=4), 4, 64, "fp32")["tp"] for s in (False, True))
    act = 4 * 64 * spec.hidden * 4
    assert tp == spec.layers * 4 * act + 2 * act + 3 * 4 * 64 * 4
    assert sp > 2 * tp - 3 * 4 * 64 * 4  # gathers + scatters count the full size, plus re-gathers in backward
