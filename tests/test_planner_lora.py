"""The planner counts LoRA (issue 18): adapters are the trainable parameters (gradients, optimizer states,
the data-parallel reduction and the update follow them), base weights are frozen in the training dtype and
sharded by ZeRO-3 only. Predicted model-state bytes per rank equal the hand formula, and equal what the
trainer's MemoryLedger counts on 1 process, dp2 ZeRO-2, dp2 ZeRO-3 and tp2 (less AdamW's 0-d step
counters, which the planner does not model). The memory check and ``tessera plan`` see LoRA jobs."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
import torch

from tessera.cli import main
from tessera.errors import ConfigError
from tessera.lora import LoRAConfig, add_lora, is_adapter_name
from tessera.models import Transformer, model_config
from tessera.planner import Layout, estimate, from_model_config, get_gpu, get_model
from tessera.planner.estimate import comm_bytes, stage_memory
from tessera.planner.flops import model_flops
from tessera.planner.gpu_kernels import stage_time
from tessera.planner.machine import usable_per_rank
from tessera.train.config import load_config, validate_config
from tessera.train.dry_run import planner_layout
from tessera.train.memory import storage_bytes
from tessera.train.memory_check import Budget, check_memory, job_spec, predicted_peak
from tessera.train.trainer import Trainer

CPU = torch.device("cpu")
TARGETS = ["wq", "wv", "wo", "w1", "w2"]
LORA = LoRAConfig(rank=4, targets=TARGETS)
STATES = ("params", "grads", "optimizer")


def counts(preset: str, lora: LoRAConfig) -> tuple[int, int]:
    """(base, adapter) parameters of the adapted model, counted on the meta device."""
    with torch.device("meta"):
        model = Transformer(model_config(preset))
    add_lora(model, lora, seed=0)
    named = dict(model.named_parameters())
    adapters = sum(p.numel() for n, p in named.items() if is_adapter_name(n))
    return sum(p.numel() for p in named.values()) - adapters, adapters


@pytest.mark.parametrize("preset,targets", [("tiny", TARGETS), ("small", ["wq", "wk", "wv", "wo"]),
                                            ("moe-small", ["wq", "wo", "w1", "w2", "w3"])])
def test_the_spec_counts_the_adapters_add_lora_makes(preset, targets):
    lora = LoRAConfig(rank=8, targets=targets)
    base, adapters = counts(preset, lora)
    spec = from_model_config(preset, model_config(preset), lora=lora)
    assert spec.num_params() == base  # the base model, as without LoRA
    assert spec.adapter_params() == adapters > 0  # moe-small: each expert's w1, w2, w3 too
    assert from_model_config(preset, model_config(preset)).adapter_params() == 0


def test_tensor_parallel_splits_each_adapter_as_its_weight():
    """tiny (h 32, 4 heads of 8, 2 kv heads, ffn 64), r 4: column-parallel wq [32→32], wv [32→16], w1
    [32→64] keep A [r, in] whole and B [out/2, r]; row-parallel wo [32→32], w2 [64→32] A [r, in/2], B whole."""
    spec = from_model_config("tiny", model_config("tiny"), lora=LORA)
    whole = 4 * ((32 + 32) + (32 + 16) + (32 + 32) + (32 + 64) + (64 + 32))
    split = 4 * ((32 + 16) + (32 + 8) + (16 + 32) + (32 + 32) + (32 + 32))
    assert spec.adapter_layer_params(1) == (whole, 0.0) and spec.adapter_layer_params(2) == (split, 0.0)
    assert counts("tiny", LORA)[1] == 2 * whole


def hand_formula(base: float, adapters: float, stage: int, n: int, precision: str) -> dict:
    """Bytes per rank: every parameter held in the training dtype e (frozen ones sharded by ZeRO-3 only),
    gradients of the adapters (e, /n from ZeRO-2), optimizer states of the adapters (K: fp32 m, v, plus the
    fp32 master under mixed precision, /n from ZeRO-1)."""
    e, k = (4, 8) if precision == "fp32" else (2, 12)
    return {"params": e * (base + adapters) / (n if stage == 3 else 1),
            "grads": e * adapters / (n if stage >= 2 else 1),
            "optimizer": k * adapters / (n if stage >= 1 else 1)}


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_lora_model_states_equal_the_hand_formula(precision):
    spec = from_model_config("tiny", model_config("tiny"), lora=LORA)
    base, adapters = counts("tiny", LORA)
    norms = 2 * 2 * 32 + 32  # tp leaves the RMSNorm weights whole on every rank
    tp_base, tp_adapters = (base - norms) / 2 + norms, 2 * 4 * (48 + 40 + 48 + 64 + 64)
    cases = {Layout(): (base, adapters, 0, 1), Layout(dp=2, zero_stage=2): (base, adapters, 2, 2),
             Layout(dp=2, zero_stage=3): (base, adapters, 3, 2), Layout(tp=2): (tp_base, tp_adapters, 0, 1)}
    full = dataclasses.replace(spec, lora_rank=0)
    for layout, (b, a, stage, n) in cases.items():
        got = stage_memory(spec, layout, 8, 32, precision, "adam", 0)[0]
        want = hand_formula(b, a, stage, n, precision)
        assert {k: got[k] for k in STATES} == pytest.approx(want, rel=1e-12), layout.describe()
        # full fine-tuning of the same model and layout: every parameter trainable
        got_full = stage_memory(full, layout, 8, 32, precision, "adam", 0)[0]
        assert {k: got_full[k] for k in STATES} == pytest.approx(hand_formula(0, b, stage, n, precision), rel=1e-12)
        assert sum(got[k] for k in STATES) < 0.5 * sum(got_full[k] for k in STATES)


def test_the_time_model_reduces_and_updates_the_adapters_only():
    full = get_model("llama3-8b")
    lora = get_model("llama3-8b", lora_rank=16)
    gpu, n_all, n_adapt = get_gpu("h100"), full.num_params(), lora.adapter_params()
    assert n_adapt == 32 * 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2)  # wq, wk, wv, wo of 32 layers
    # data parallel: DDP all-reduces the adapters' gradients only; ZeRO-3 still gathers the frozen weights
    assert comm_bytes(lora, Layout(dp=8, micro_batch=1), 8, 512, "fp32")["dp"] == pytest.approx(4 * n_adapt)
    z3 = comm_bytes(lora, Layout(dp=8, zero_stage=3, micro_batch=1), 8, 512, "fp32")["dp"]
    # ... twice, less the root unit (the final norm) and the frozen embedding, neither gathered for backward
    assert z3 == pytest.approx(2 * 4 * (n_all + n_adapt) + 4 * n_adapt - 4 * 4096 - 4 * 128256 * 4096)
    # FLOPs: a frozen weight costs forward + input gradient (4 per token), an adapter weight 6
    tokens, seq = 8 * 512, 512
    attention = 12 * 32 * 4096 * seq
    assert model_flops(lora, tokens, seq) == pytest.approx(
        tokens * (4 * full.matmul_params_per_token() + 6 * n_adapt + attention))
    layout = Layout(dp=8, zero_stage=1, micro_batch=1)
    flat = get_gpu("h100", hbm_efficiency=0.0, attention_flops=0.0)  # every FLOP at one rate
    ratio = model_flops(lora, tokens, seq) / model_flops(full, tokens, seq)
    a, b = estimate(full, layout, flat, 64, 512), estimate(lora, layout, flat, 64, 512)
    assert b.time_s["compute"] / a.time_s["compute"] == pytest.approx(ratio) and ratio < 0.7
    # the GPU kernel model: the matmuls shrink as their FLOPs (4 per frozen weight, 6 per adapter weight);
    # attention and the non-matmul kernels are the same work with or without adapters
    ma, mb = (stage_time(s, layout, gpu, 512, 2) for s in (full, lora))
    matmul_ratio = (4 * full.matmul_params_per_token() + 6 * n_adapt) / (6 * full.matmul_params_per_token())
    assert mb.matmul / ma.matmul == pytest.approx(matmul_ratio, rel=1e-6)
    assert (mb.attention, mb.elementwise) == (ma.attention, ma.elementwise)
    a, b = estimate(full, layout, gpu, 64, 512), estimate(lora, layout, gpu, 64, 512)
    assert b.time_s["optimizer"] == pytest.approx(a.time_s["optimizer"] * n_adapt / n_all)  # adapters' states only
    assert b.time_s["dp_exposed"] < a.time_s["dp_exposed"] / 100  # no frozen gradient reduced or gathered


def job(*flags: str, world: int = 2):
    cfg = validate_config(load_config(None, [*flags, f"--run.nproc={world}"]), world)
    return cfg, cfg.parallel.resolved(world)


def test_the_memory_check_sees_lora_jobs():
    common = ("--model.preset=small", "--parallel.dp_replicate=2", "--data.global_batch_size=8")
    full, full_par = job(*common)
    lora, lora_par = job(*common, "--lora.rank=8", '--lora.targets=["wq", "wv"]')
    spec = job_spec(lora)
    assert (spec.lora_rank, spec.lora_targets) == (8, ("wq", "wv"))
    layout, batch, _ = planner_layout(lora, lora_par)
    mem, _ = stage_memory(spec, layout, batch, lora.data.seq_len, "fp32", "adam", 0)
    base, adapters = counts("small", LoRAConfig(rank=8, targets=["wq", "wv"]))
    assert {k: mem[k] for k in STATES} == pytest.approx(hand_formula(base, adapters, 0, 1, "fp32"))
    need_full, need_lora = predicted_peak(full, full_par), predicted_peak(lora, lora_par)
    # fp32 full fine-tuning holds 4 + 4 + 8 bytes per weight; LoRA 4 per weight, and 4 + 8 per adapter weight
    assert need_full - need_lora == pytest.approx(12 * base - 16 * adapters)
    between = (need_full + need_lora) / 2 / usable_per_rank(1.0)
    budget = Budget(between, 2, "a test machine", True)
    check_memory(lora, lora_par, 2, budget)  # fits
    with pytest.raises(ConfigError, match="predicted peak memory"):
        check_memory(full, full_par, 2, budget)


PLAN = ["plan", "--model", "tessera-tiny", "--gpus", "2", "--global-batch", "8", "--seq", "32", "--precision",
        "fp32", "--top", "2", "--lora-rank", "4", "--lora-targets", ",".join(TARGETS)]


def test_tessera_plan_ranks_lora_layouts_the_trainer_runs(capsys):
    assert main([*PLAN, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = from_model_config("tessera-tiny", model_config("tiny"), lora=LORA)
    for entry in out["layouts"]:
        flags = entry["train_flags"]
        assert "--lora.rank=4" in flags and f"--lora.targets={json.dumps(TARGETS)}" in flags
        cfg = validate_config(load_config(None, flags), 2)  # the trainer accepts them as printed
        assert cfg.lora == LORA
        layout = Layout(**entry["layout"])
        mem = stage_memory(spec, layout, 8, 32, "fp32", "adam", 0)[0]
        assert entry["memory_bytes"]["grads"] == round(mem["grads"]) < 4 * spec.num_params() / 10
    assert main(PLAN) == 0
    text = capsys.readouterr().out
    assert "LoRA rank 4 on wq,wv,wo,w1,w2" in text
    common = next(line for line in text.splitlines() if line.startswith("tessera train "))
    assert f"--lora.targets={json.dumps(TARGETS)}" in shlex.split(common)  # quoted for a shell


def test_a_bad_lora_target_is_one_sentence(capsys):
    assert main([*PLAN[:-2], "--lora-targets", "router"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera: error: model tessera-tiny: lora_targets must name") and err.count("\n") == 1


# ---- the trainer's ledger (multi-rank) ----------------------------------------------------------------


def ledger_worker(rank, world_size, args):
    """Train ``args`` for 2 steps; the ledger's model states of every rank after the last step, and the
    bytes of AdamW's 0-d step counters among this rank's optimizer state (the planner leaves them out)."""
    cfg = validate_config(load_config(None, args), world_size)
    trainer = Trainer(cfg, CPU)
    try:
        summary = trainer.fit()
        ledger = trainer.memory
        if ledger.state_fn is not None:
            held = ledger.state_fn()["optimizer"]
        else:
            held = [v for s in ledger.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        steps = storage_bytes([t for t in held if t.dim() == 0])
    finally:
        trainer.close()
    return {"memory": summary["memory_per_rank"], "steps": steps}  # memory: rank 0 only


TP2 = ["--parallel.dp_replicate=1", "--parallel.tp=2"]
LORA_FLAGS = ["--lora.rank=4", f"--lora.targets={json.dumps(TARGETS)}"]
LAYOUTS = {  # name: (world, flags)
    "one": (1, LORA_FLAGS),
    "dp2-zero2": (2, [*LORA_FLAGS, "--parallel.dp_replicate=1", "--parallel.dp_shard=2", "--parallel.zero_stage=2"]),
    "dp2-zero3": (2, [*LORA_FLAGS, "--parallel.dp_replicate=1", "--parallel.dp_shard=2", "--parallel.zero_stage=3"]),
    "tp2": (2, [*LORA_FLAGS, *TP2]),
    "tp2-full": (2, TP2),  # full fine-tuning: tp leaves the norms whole on every rank, as the planner counts
}


def ledger_args(tmp_path, cache, name, extra):
    return ["--model.preset=tiny", "--train.steps=2", "--train.log_every=1", "--train.eval_every=2",
            "--data.seq_len=32", "--data.global_batch_size=8", "--data.micro_batch_size=2",
            "--data.eval_batches=1", f"--data.cache_dir={cache}", f"--run.out_dir={tmp_path}",
            "--run.progress=false", "--optim.warmup_steps=1", "--checkpoint.save_final=false",
            f"--run.name={name}", *extra]


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_predicted_model_states_equal_the_trainers_ledger(rank_pool, tmp_path, corpus_cache, name, dtype):
    world, flags = LAYOUTS[name]
    args = ledger_args(tmp_path, corpus_cache, name, [*flags, f"--precision.dtype={dtype}"])
    results = [ledger_worker(0, 1, args)] if world == 1 else rank_pool.run(ledger_worker, world, args=args)
    cfg = validate_config(load_config(None, args), world)
    layout, batch, _ = planner_layout(cfg, cfg.parallel.resolved(world))
    want = stage_memory(job_spec(cfg), layout, batch, 32, "fp32" if dtype == "fp32" else "mixed", "adam", 0)[0]
    for rank, r in enumerate(results):
        got = results[0]["memory"][rank]  # rank 0 gathers every rank's ledger
        assert got["params"] == want["params"] and got["grads"] == want["grads"], (rank, got, want)
        assert got["optimizer"] == want["optimizer"] + r["steps"], (rank, got, want)
        assert 0 < r["steps"] <= 4 * 64  # a few 4-byte counters, one per parameter tensor at most
    # bytes on the wire per step: adapters' gradients only (ZeRO-2: every micro-batch's), ZeRO-3's gathers
    # of the frozen weights (none for the embedding's backward), tp's adapter-factor all-reduces
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    measured = [r["comm_per_step"] for r in lines if r["kind"] == "train"][-1]
    predicted = comm_bytes(job_spec(cfg), layout, batch, 32, "fp32" if dtype == "fp32" else "mixed")
    for axis, names in {"dp": ("dp", "dp_shard", "dp_cp"), "tp": ("tp",)}.items():
        got = sum(v["bytes"] for k, v in measured.items() if k.split("/")[0] in names)
        assert abs(got - predicted[axis]) <= 32, (axis, got, predicted[axis])  # + the 4-8 byte loss scalars
