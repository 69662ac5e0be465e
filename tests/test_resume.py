"""Resuming a run: stopped at step k and resumed, it repeats the uninterrupted run's losses exactly.

A failure is simulated by deleting every checkpoint after step k from a copy of a finished run (its
metrics.jsonl and progress.json still show the later steps, as a killed run's would); the copy is then
resumed with ``checkpoint.resume=auto`` and must end with the same records, bit for bit.
"""

import json
import shutil

import pytest

from tessera.launch import run_rank
from tessera.train.config import load_config
from tessera.checkpoint import checkpoints

from test_trainer import tiny_args, trainer_worker

STEPS, EVERY = 8, 3


def args(out, cache, name, extra=()):
    return tiny_args(out, cache, steps=STEPS, extra=[
        f"--run.name={name}", "--train.log_every=1", f"--checkpoint.every={EVERY}", "--checkpoint.keep=5",
        *extra])


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def crash_after(run_dir, copy_dir, step):
    """A copy of a finished run as a failure after ``step``'s checkpoint would have left it."""
    shutil.copytree(run_dir, copy_dir)
    for saved, path in checkpoints(copy_dir / "checkpoint"):
        if saved > step:
            shutil.rmtree(path)
    (copy_dir / "summary.json").unlink()


def same_records(a, b):
    keys = ("kind", "step", "loss", "grad_norm", "lr", "val_loss")
    assert [{k: r.get(k) for k in keys} for r in a] == [{k: r.get(k) for k in keys} for r in b]


def test_single_process_resume_repeats_the_run_exactly(tmp_path, corpus_cache):
    full = run_rank(load_config(None, args(tmp_path, corpus_cache, "full")))
    assert [p.name for _, p in checkpoints(tmp_path / "full" / "checkpoint")] == [
        "step_000003", "step_000006", "step_000008"]
    crash_after(tmp_path / "full", tmp_path / "part", 3)
    resumed = run_rank(load_config(None, args(tmp_path, corpus_cache, "part", ["--checkpoint.resume=auto"])))
    assert resumed["resumed_from_step"] == 3 and resumed["steps_lost"] == STEPS - 3
    assert resumed["val_loss_end"] == full["val_loss_end"]
    same_records(records(tmp_path / "full"), records(tmp_path / "part"))


def test_resume_auto_without_a_checkpoint_starts_fresh(tmp_path, corpus_cache):
    summary = run_rank(load_config(None, args(tmp_path, corpus_cache, "fresh", ["--checkpoint.resume=auto",
                                                                                "--checkpoint.every=0"])))
    assert summary["resumed_from_step"] is None and summary["run_dir"].endswith("fresh")


@pytest.mark.multirank
def test_data_parallel_resume_repeats_the_run_exactly(rank_pool, tmp_path, corpus_cache):
    full = rank_pool.run(trainer_worker, 2, args=args(tmp_path, corpus_cache, "full"))[0]
    crash_after(tmp_path / "full", tmp_path / "part", 6)
    resumed = rank_pool.run(trainer_worker, 2, args=args(tmp_path, corpus_cache, "part",
                                                          ["--checkpoint.resume=auto"]))[0]
    assert resumed["resumed_from_step"] == 6 and resumed["val_loss_end"] == full["val_loss_end"]
    same_records(records(tmp_path / "full"), records(tmp_path / "part"))


RESHARD = {  # saved under one layout (world, overrides), resumed under another
    "dp2-to-single": ((2, []), (1, [])),
    "dp2-to-tp2": ((2, []), (2, ["--parallel.tp=2"])),
    "tp2-to-dp4": ((2, ["--parallel.tp=2"]), (4, [])),
    "tp2xpp2-to-dp4": ((4, ["--parallel.tp=2", "--parallel.pp=2", "--pipeline.schedule=1f1b",
                            "--pipeline.microbatches=4"]), (4, [])),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(RESHARD))
def test_resume_on_another_layout_continues_the_run(rank_pool, tmp_path, corpus_cache, name):
    """The checkpoint of step 3 reshards into the new layout; the continued run's losses and gradient
    norms equal the uninterrupted run's within fp32 tolerance (reduction order differs)."""
    (world_a, extra_a), (world_b, extra_b) = RESHARD[name]
    full = rank_pool.run(trainer_worker, world_a, args=args(tmp_path, corpus_cache, "full", extra_a))[0]
    start = tmp_path / "full" / "checkpoint" / "step_000003"
    resume_args = args(tmp_path, corpus_cache, "next", [*extra_b, f"--checkpoint.resume={start}"])
    if world_b == 1:
        resumed = run_rank(load_config(None, resume_args))
    else:
        resumed = rank_pool.run(trainer_worker, world_b, args=resume_args)[0]
    assert resumed["resumed_from_step"] == 3
    assert resumed["val_loss_end"] == pytest.approx(full["val_loss_end"], rel=1e-5)
    before = {r["step"]: r for r in records(tmp_path / "full") if r["kind"] == "train"}
    after = [r for r in records(tmp_path / "next") if r["kind"] == "train"]
    assert [r["step"] for r in after] == list(range(4, STEPS + 1))
    for r in after:
        assert r["loss"] == pytest.approx(before[r["step"]]["loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(before[r["step"]]["grad_norm"], rel=1e-4)
