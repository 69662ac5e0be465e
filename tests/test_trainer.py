"""The trainer end to end: one process in-process, N ranks on the pool against one, and the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.launch import run_rank
from tessera.models import Transformer
from tessera.checkpoint import checkpoint_tensors
from tessera.train.checkpoint import load_model
from tessera.train.config import load_config
from tessera.train.optim import build_optimizer

ROOT = Path(__file__).resolve().parent.parent


def tiny_args(out_dir, cache, steps=6, extra=()):
    return ["--model.preset=tiny", f"--train.steps={steps}", "--train.log_every=2", "--train.eval_every=3",
            "--data.seq_len=32", "--data.global_batch_size=8", "--data.micro_batch_size=2",
            "--data.eval_batches=2", f"--data.cache_dir={cache}", f"--run.out_dir={out_dir}",
            "--run.progress=false", "--optim.warmup_steps=2", *extra]


def test_single_process_run_writes_everything(tmp_path, corpus_cache):
    cfg = load_config(None, tiny_args(tmp_path, corpus_cache, steps=6, extra=["--run.name=one"]))
    summary = run_rank(cfg)
    run = tmp_path / "one"
    for name in ("config.toml", "metrics.jsonl", "summary.json", "loss.png", "checkpoint/step_000006/.metadata",
                 "checkpoint/step_000006/trainer.json", "progress.json"):
        assert (run / name).exists(), name
    written = json.loads((run / "summary.json").read_text())
    assert written["val_loss_end"] == summary["val_loss_end"]
    assert written["memory_per_rank"][0]["params"] == summary["parameters"] * 4
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert {"loss", "lr", "tokens_per_s", "grad_norm", "comm_per_step", "memory"} <= set(train[0])
    mem = train[0]["memory"][0]
    assert mem["params"] == summary["parameters"] * 4 and mem["optimizer"] >= 2 * mem["params"]
    assert mem["grads"] == mem["params"] and mem["activations"] > 0
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [0, 3, 6]
    # the checkpoint holds the final weights and optimizer state
    model = Transformer(cfg.model)
    meta = load_model(run / "checkpoint" / "step_000006", model)
    assert meta["step"] == 6 and meta["sampler"]["samples_consumed"] == 6 * 8
    torch.manual_seed(cfg.run.seed)
    initial = Transformer(cfg.model).state_dict()
    assert all(not torch.equal(v, initial[k]) for k, v in model.state_dict().items() if k.endswith("wq.weight"))
    # a second run with the same name never overwrites the first
    assert run_rank(cfg)["run_dir"].endswith("one-2")


def trainer_worker(rank, world_size, args):
    cfg = load_config(None, args)
    summary = run_rank(cfg)
    return summary


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_trainer_matches_single_process(rank_pool, tmp_path, corpus_cache, world):
    """Sampler sharding, token weighting, DDP and clipping together: N ranks train like one process."""
    single = run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, extra=["--run.name=ref"])))
    results = rank_pool.run(trainer_worker, world, args=tiny_args(tmp_path, corpus_cache, extra=["--run.name=dp"]))
    assert results[0]["layout"].startswith(f"{world} rank(s): dp_replicate={world}")
    for key in ("val_loss_start", "val_loss_end", "train_loss_end"):
        assert results[0][key] == pytest.approx(single[key], rel=1e-5), key
    ref = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(ref, got):
        if a["kind"] == "train":
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
            assert len(b["memory"]) == world
    # with the model replicated, each rank holds the same parameter bytes as the single process
    assert got[1]["memory"][-1]["params"] == ref[1]["memory"][0]["params"]


def group_alive_worker(rank, world_size):
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


@pytest.mark.multirank
def test_trainer_leaves_a_callers_process_group_alone(rank_pool, tmp_path, corpus_cache):
    rank_pool.run(trainer_worker, 2, args=tiny_args(tmp_path, corpus_cache, steps=1))
    assert rank_pool.run(group_alive_worker, 2) == [2.0, 2.0]


def test_failed_ranks_become_one_sentence_with_the_right_exit_code():
    from types import SimpleNamespace

    from tessera.spawn import failure as _failure

    user = SimpleNamespace(failures={1: SimpleNamespace(exitcode=2), 0: SimpleNamespace(exitcode=2)})
    crash = SimpleNamespace(failures={0: SimpleNamespace(exitcode=-9)})
    assert str(_failure(user)) == "rank 0 exited with code 2, rank 1 exited with code 2 (its error is printed above)"
    assert _failure(user).exit_code == 2 and _failure(crash).exit_code == 1


@pytest.mark.multirank
def test_trainer_zero3_matches_single_process_and_bf16_tracks_it(rank_pool, tmp_path, corpus_cache):
    """ZeRO-3 with hybrid-free sharding over 2 ranks and selective recompute trains like one process in
    fp32; in bf16 (fp32 master weights) the loss curve stays close to the fp32 one."""
    single = run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, extra=["--run.name=ref"])))
    zero = ["--parallel.zero_stage=3", "--checkpointing.mode=selective"]
    fp32 = rank_pool.run(trainer_worker, 2, args=tiny_args(tmp_path, corpus_cache, extra=["--run.name=z3", *zero]))
    for key in ("val_loss_start", "val_loss_end", "train_loss_end"):
        assert fp32[0][key] == pytest.approx(single[key], rel=1e-5), key
    assert fp32[0]["parameters"] == single["parameters"]
    # every rank holds half of the fp32 parameters, gradients and optimizer state of the single process
    ref_mem, mem = single["memory_per_rank"][0], fp32[0]["memory_per_rank"]
    for r in mem:
        assert r["params"] == pytest.approx(ref_mem["params"] / 2, rel=0.01)
        assert r["grads"] == pytest.approx(ref_mem["grads"] / 2, rel=0.01)
    bf16 = rank_pool.run(trainer_worker, 2, args=tiny_args(
        tmp_path, corpus_cache, extra=["--run.name=z3bf16", *zero, "--precision.dtype=bf16"]))
    ref = [json.loads(x) for x in (tmp_path / "z3" / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (tmp_path / "z3bf16" / "metrics.jsonl").read_text().splitlines()]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(ref, got) if a["kind"] == "train"]
    assert diffs and max(diffs) < 0.02, diffs
    assert bf16[0]["skipped_steps"] == 0
    # bf16 parameters: 2 bytes per element on each rank's half
    assert bf16[0]["memory_per_rank"][0]["params"] == pytest.approx(ref_mem["params"] / 4, rel=0.01)


def test_cli_rejects_an_impossible_memory_saver_combination_before_any_rank_starts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "train", "--nproc", "2", "--zero.offload=true",
         f"--run.out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "tessera: error: zero.offload moves the sharded optimizer to the host, so it needs "
        "parallel.zero_stage of 1, 2 or 3"]
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.slow
def test_cli_spawns_ranks_through_the_elastic_launcher_and_trains_zero3_bf16_selective(tmp_path, corpus_cache):
    # one torchrun job for both checks: the launcher's start-up is most of a CLI run's time
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "train", "--nproc", "2", "--parallel.zero_stage=3",
         "--precision.dtype=bf16", "--checkpointing.mode=selective", *tiny_args(tmp_path, corpus_cache, steps=4)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["layout"].startswith("2 rank(s): dp_replicate=2"), summary["layout"]
    assert summary["val_loss_end"] < summary["val_loss_start"]
    step_dir = Path(summary["run_dir"]) / "checkpoint" / "step_000004"
    assert (step_dir / "__1_0.distcp").exists()  # rank 1 wrote its part
    saved = checkpoint_tensors(step_dir)
    assert saved["optim/output.weight/exp_avg"] == (256, 32)  # ZeRO-3 shards stored with global shapes
