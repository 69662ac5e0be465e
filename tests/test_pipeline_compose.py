"""Pipeline parallelism with the data-parallel side of every layout: mixed precision (fp32 master weights,
bf16 and fp16 with dynamic loss scaling), ZeRO-2 and ZeRO-3 with gradients reduced once per step, and the
asynchronous schedules through a ZeRO engine or under tensor parallelism. The full trainer runs each
layout on the rank pool: fp32 layouts equal one process (losses rel 1e-5, gradient norms rel 1e-4, every
one of 4 steps, validation losses too); low-precision layouts track the fp32 one-process curve within
the bound of tests/test_precision.py::test_low_precision_tracks_the_fp32_loss_curve, yet differ from it.
For PipeDream / 2BW "one process" is the same schedule at pp=2 (their weight versions define the math).
"""

from __future__ import annotations

import pytest

from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.train.config import load_config, validate_config

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, metrics

BASE = ["--model.n_layers=4", "--checkpoint.save_final=false", "--train.log_every=1", "--train.eval_every=4",
        "--data.eval_batches=1"]
STEPS = 4
PP = ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"]
BOUND = 0.01  # test_precision's bound on the largest loss difference from the fp32 curve


def _args(tmp_path, corpus_cache, name, extra):
    return tiny_args(tmp_path, corpus_cache, steps=STEPS, extra=[*BASE, *extra, f"--run.name={name}"])


def _train(rank_pool, tmp_path, corpus_cache, name, world, extra):
    """Run a layout through the trainer on ``world`` pool ranks: (every rank's summary, metrics lines)."""
    args = _args(tmp_path, corpus_cache, name, extra)
    validate_config(load_config(None, args), world)  # the layout passes validation before any rank starts
    results = rank_pool.run(trainer_worker, world, args=args, timeout=600.0)
    return results, metrics(tmp_path / name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache):
    """The fp32 one-process run of the dense model."""
    out = tmp_path_factory.mktemp("reference")
    summary = run_rank(load_config(None, _args(out, corpus_cache, "ref", [])))
    return summary, metrics(out / "ref")


def _train_lines(lines):
    return [r for r in lines if r["kind"] == "train"]


def _largest_loss_difference(ref, got):
    want, have = _train_lines(ref), _train_lines(got)
    assert len(want) == len(have) == STEPS and all(r["loss"] is not None for r in have)
    return max(abs(a["loss"] - b["loss"]) for a, b in zip(want, have))


@pytest.mark.multirank
@pytest.mark.parametrize("name, world, extra", [
    ("pp2-bf16", 2, ["--precision.dtype=bf16"]),
    ("pp2xdp2-fp32-reduce-bf16", 4, ["--precision.reduce_dtype=bf16"]),
    ("pp2xdp2-zero1-bf16", 4, ["--precision.dtype=bf16", "--parallel.zero_stage=1"]),
])
def test_pipeline_in_low_precision_tracks_the_fp32_curve(rank_pool, tmp_path, corpus_cache, reference,
                                                          name, world, extra):
    """bf16 stages (fp32 master weights in the engine, activations sent between stages in bf16), and fp32
    stages whose gradients are reduced in bf16: close to the fp32 one-process curve, but not equal."""
    _, ref = reference
    results, got = _train(rank_pool, tmp_path, corpus_cache, name, world, [*PP, *extra])
    diff = _largest_loss_difference(ref, got)
    print(f"\n{name} vs fp32 one process: largest loss difference {diff:.5f}")
    assert 0 < diff < BOUND
    assert len({r["val_loss_end"] for r in results}) == 1 and results[0]["skipped_steps"] == 0
    full = _train_lines(ref)[-1]["memory"][0]["params"]  # fp32 bytes of the whole model
    stages = sum(m["params"] for m in _train_lines(got)[-1]["memory"]) * 2 // world  # one replica's
    assert stages == (full // 2 if "--precision.dtype=bf16" in extra else full)  # bf16: half the bytes


@pytest.mark.multirank
def test_pipeline_in_fp16_scales_the_loss_job_wide(rank_pool, tmp_path, corpus_cache):
    """fp16 with dynamic loss scaling: a first scale too large for fp16 overflows; every rank skips those
    steps together and halves the scale, as one process in fp16 does, then the losses track its curve."""
    extra = [f"--precision.init_scale={2.0 ** 18}", "--train.steps=8", "--precision.dtype=fp16"]
    single = run_rank(load_config(None, _args(tmp_path, corpus_cache, "one-fp16", extra)))
    want = _train_lines(metrics(tmp_path / "one-fp16"))
    results, got = _train(rank_pool, tmp_path, corpus_cache, "pp2-fp16", 2, [*PP, *extra])
    train = _train_lines(got)
    skipped = [s for r in train for s in r["skipped_at"]]
    print(f"\nfp16 pp2: skipped steps {skipped}, scale now {train[-1]['loss_scale']}")
    assert skipped == [s for r in want for s in r["skipped_at"]] and skipped[0] == 1  # the same steps
    assert all(r["skipped_steps"] == len(skipped) for r in results)  # one decision on every rank
    assert train[-1]["loss_scale"] == want[-1]["loss_scale"] == 2.0 ** 18 / 2 ** len(skipped)
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(want, train) if a["loss"] is not None)
    assert diff < BOUND and results[0]["val_loss_end"] < results[0]["val_loss_start"]
    assert results[0]["val_loss_end"] == pytest.approx(single["val_loss_end"], abs=BOUND)


@pytest.mark.multirank
def test_pipeline_with_zero2_matches_single_process_and_reduces_once_per_step(rank_pool, tmp_path, corpus_cache,
                                                                               reference):
    """pp2 × dp2 × ZeRO-2 with 4 micro-batches per step: one reduce-scatter per gradient bucket per step
    (the accumulated gradients after the last backward), and the one-process losses and norms."""
    single, ref = reference
    extra = ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=4",
             "--parallel.zero_stage=2", "--zero.bucket_mb=0.05"]
    results, got = _train(rank_pool, tmp_path, corpus_cache, "pp2xdp2-zero2", 4, extra)
    assert_like_single_process(results, single, ref, got, 4)
    comm = _train_lines(got)[-1]["comm_per_step"]
    scatters = [v["count"] for k, v in comm.items() if k.endswith("reduce_scatter")]
    gathers = [v["count"] for k, v in comm.items() if k.endswith("all_gather")]
    assert scatters and scatters[0] > 1 and scatters == gathers  # several buckets, each reduced once


PIPEDREAM = ["--parallel.pp=2", "--pipeline.schedule=pipedream", "--pipeline.microbatches=2"]


@pytest.mark.multirank
def test_pipedream_through_zero_engines_matches_pipedream_without(rank_pool, tmp_path, corpus_cache):
    """PipeDream async × ZeRO-1 and × ZeRO-2: the in-schedule updates go through the engine (reduce-scatter,
    clip by the global norm, sharded step, all-gather into the flat buffers the stashed versions were
    copied from) exactly as the plain optimizer of pp2 × dp2 does them; in bf16 (master weights) the run
    tracks that fp32 curve."""
    plain, plain_lines = _train(rank_pool, tmp_path, corpus_cache, "pipedream", 4, PIPEDREAM)
    for stage in (1, 2):
        results, got = _train(rank_pool, tmp_path, corpus_cache, f"pipedream-zero{stage}", 4,
                              [*PIPEDREAM, f"--parallel.zero_stage={stage}"])
        assert_like_single_process(results, plain[0], plain_lines, got, 4)
        assert any(k.endswith("reduce_scatter") for k in _train_lines(got)[-1]["comm_per_step"])
    results, got = _train(rank_pool, tmp_path, corpus_cache, "pipedream-bf16", 2,
                          [*PIPEDREAM, "--precision.dtype=bf16"])
    assert 0 < _largest_loss_difference(plain_lines, got) < BOUND


SP = "--tensor_parallel.sequence_parallel=true"


@pytest.mark.multirank
@pytest.mark.parametrize("schedule, variants", [
    ("pipedream", {"tp2-sp": ["--parallel.tp=2", SP]}),
    ("2bw", {"tp2": ["--parallel.tp=2"], "dp2-zero2": ["--parallel.zero_stage=2"]}),
])
def test_weight_stashing_schedules_under_tensor_parallelism_and_zero(rank_pool, tmp_path, corpus_cache, reference,
                                                                     schedule, variants):
    """tp2 × pp2 with PipeDream / 2BW equals pp2 with the same schedule: each tp rank stashes its own
    slices of every weight version, and the forward of a version is the same tp-split computation (with
    sequence parallelism, on sequence shards). 2BW's update through ZeRO-2 after the step (all-gathered
    into the flat buffers the kept version was copied from) too. All differ from the flush schedule."""
    extra = ["--parallel.pp=2", f"--pipeline.schedule={schedule}", "--pipeline.microbatches=2"]
    plain, plain_lines = _train(rank_pool, tmp_path, corpus_cache, schedule, 2, extra)
    for name, flags in variants.items():
        results, got = _train(rank_pool, tmp_path, corpus_cache, f"{schedule}-{name}", 4, [*extra, *flags])
        assert_like_single_process(results, plain[0], plain_lines, got, 4)
        assert _largest_loss_difference(reference[1], got) > 1e-4  # stale weight versions: not the flush math


@pytest.mark.multirank
@pytest.mark.parametrize("reshard, tied", [(True, False), (False, True)])
def test_pipeline_with_zero3_matches_single_process(rank_pool, tmp_path, corpus_cache, reference, reshard, tied):
    """pp2 × dp2 × ZeRO-3, 4 micro-batches: gradients accumulate in each unit's full gradient and are
    reduce-scattered once per step; the units are re-gathered for every micro-batch's forward and backward
    (``zero.reshard_after_forward``) or kept gathered through the step; a tied embedding's two copies are
    summed in their flat gradients. Either way: one process."""
    tie = ["--model.tie_embeddings=true"] if tied else []
    single, ref = reference
    if tied:
        single = run_rank(load_config(None, _args(tmp_path, corpus_cache, "one-tied", tie)))
        ref = metrics(tmp_path / "one-tied")
    name = f"pp2xdp2-zero3-reshard-{reshard}"
    extra = ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=4", *tie,
             "--parallel.zero_stage=3", f"--zero.reshard_after_forward={str(reshard).lower()}"]
    results, got = _train(rank_pool, tmp_path, corpus_cache, name, 4, extra)
    assert_like_single_process(results, single, ref, got, 4)
    comm = _train_lines(got)[-1]["comm_per_step"]  # global rank 0's: pp rank 0, its stage's units
    scatters, gathers = comm["dp/reduce_scatter"]["count"], comm["dp/all_gather"]["count"]
    print(f"\n{name}: per step {scatters:g} reduce-scatters, {gathers:g} all-gathers")
    # one reduce-scatter per flat per step; all-gathers: 2 per flat and micro-batch, or 1 per flat
    assert gathers == (2 * 4 * scatters if reshard else scatters)



MOE = ["--model.num_experts=4", "--moe.top_k=2"]


@pytest.mark.multirank
@pytest.mark.parametrize("zero", [0, 2])
def test_pipeline_with_expert_parallelism_matches_single_process(rank_pool, tmp_path, corpus_cache, zero):
    """pp2 × ep2 (carved out of dp2) of a mixture-of-experts model: each stage's experts split over ep, the
    data-parallel side the expert engines in manual mode (dense gradients over dp, expert gradients over
    edp — one rank here, dp / ep — once per step), plain or ZeRO-2. One process."""
    single = run_rank(load_config(None, _args(tmp_path, corpus_cache, "one-moe", MOE)))
    ref = metrics(tmp_path / "one-moe")
    extra = [*PP, *MOE, "--parallel.ep=2", f"--parallel.zero_stage={zero}"]
    results, got = _train(rank_pool, tmp_path, corpus_cache, f"pp2xep2-zero{zero}", 4, extra)
    assert_like_single_process(results, single, ref, got, 4)
    assert any(k.startswith("ep/") for k in _train_lines(got)[-1]["comm_per_step"])  # tokens sent to experts

def _validate(world, extra):
    validate_config(load_config(None, ["--model.preset=tiny", "--model.n_layers=4", "--data.seq_len=32",
                                       "--data.global_batch_size=8", "--data.micro_batch_size=2", *extra]), world)


@pytest.mark.parametrize("world, extra", [
    (2, [*PP, "--precision.dtype=fp16"]), (4, [*PP, "--parallel.zero_stage=2", "--precision.dtype=bf16"]),
    (4, [*PP, "--parallel.zero_stage=3"]), (4, [*PIPEDREAM, "--parallel.zero_stage=1"]),
    (4, [*PIPEDREAM, "--parallel.tp=2"]), (4, ["--parallel.pp=2", "--pipeline.schedule=2bw", "--parallel.tp=2"]),
])
def test_pipeline_pairings_pass_validation(world, extra):
    _validate(world, extra)


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_zero3_with_weight_stashing_is_refused_with_its_reason(schedule):
    with pytest.raises(ConfigError, match="ZeRO-3 with the weight-stashing") as err:
        _validate(4, ["--parallel.pp=2", f"--pipeline.schedule={schedule}", "--parallel.zero_stage=3"])
    assert "full copy of the stage's parameters" in str(err.value) and "\n" not in str(err.value)
