"""Profiler traces of chosen steps ([profile]) and each step's time split (train.time_breakdown)."""

import json

import pytest

from tessera.comm.ledger import CommLedger
from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.train.config import load_config, validate_config
from tessera.observe.step_time import StepTimer, split_fields

PARTS = ("time_forward", "time_backward", "time_optimizer", "time_comm_wait")


def tiny_args(out_dir, cache, name, steps=3, extra=()):
    return ["--model.preset=tiny", f"--train.steps={steps}", "--train.log_every=1", "--train.eval_every=100",
            "--data.seq_len=32", "--data.global_batch_size=8", "--data.micro_batch_size=2",
            "--data.eval_batches=1", f"--data.cache_dir={cache}", f"--run.out_dir={out_dir}",
            f"--run.name={name}", "--run.progress=false", "--checkpoint.save_final=false", *extra]


def train_lines(run):
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["kind"] == "train"]


def trainer_worker(rank, world_size, args):
    return run_rank(load_config(None, args))


def test_step_timer_takes_communication_out_of_the_phase_it_happened_in():
    """A collective's blocked seconds inside a phase count as comm_wait, not as that phase's compute."""
    import torch

    ledger = CommLedger()
    timer = StepTimer(torch.device("cpu"), ledger, enabled=True)
    timer.start()
    ledger.record("dp", "all_reduce", 8, 8.0, seconds=0.5)  # outside any phase: still waiting
    with timer.phase("backward"):
        ledger.record("dp", "all_reduce", 8, 8.0, seconds=100.0)  # longer than the phase's wall time
    split = timer.take()
    assert split["comm_wait"] == pytest.approx(100.5)
    assert split["backward"] == 0.0  # clamped: never negative
    assert split_fields({"forward": 3.0, "comm_wait": 1.0}, 2) == {"time_comm_wait": 0.5, "time_forward": 1.5}
    off = StepTimer(torch.device("cpu"), ledger, enabled=False)
    off.start()
    with off.phase("forward"):
        pass
    assert off.take() == {}


@pytest.mark.parametrize("extra, message", [
    (["--profile.steps=[4]"], "profile.steps holds 4"),
    (["--profile.steps=[0]"], "counted from 1"),
    (["--profile.dir=traces"], "no effect without profile.steps"),
])
def test_profile_steps_outside_the_run_are_refused_before_launch(tmp_path, extra, message):
    cfg = load_config(None, tiny_args(tmp_path, tmp_path, "x", steps=3, extra=extra))
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, 1)


@pytest.mark.multirank
def test_profile_traces_and_time_split_on_two_ranks(rank_pool, tmp_path, corpus_cache):
    """DDP on 2 ranks: one Chrome trace per rank of exactly step 2; every train line carries the split,
    non-negative and summing to at most the step's time; without the setting no split is written."""
    args = tiny_args(tmp_path, corpus_cache, "traced", extra=["--profile.steps=[2]", "--train.time_breakdown=true"])
    rank_pool.run(trainer_worker, 2, args=args)
    run = tmp_path / "traced"
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank0-step2.json", "rank1-step2.json"]
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank{rank}-step2.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "tessera step 2" in names and len(trace["traceEvents"]) > 10
    lines = train_lines(run)
    assert [r["step"] for r in lines] == [1, 2, 3]
    for r in lines:
        step_seconds = 8 * 32 / r["tokens_per_s"]  # one step per line, 8 × 32 target tokens each
        assert all(r[k] >= 0.0 for k in PARTS), r
        assert sum(r[k] for k in PARTS) <= step_seconds * (1 + 1e-9)
        assert r["time_forward"] > 0 and r["time_backward"] > 0 and r["time_comm_wait"] > 0
    rank_pool.run(trainer_worker, 2, args=tiny_args(tmp_path, corpus_cache, "plain", steps=1))
    assert not any(k.startswith("time_") for k in train_lines(tmp_path / "plain")[0])
    assert not (tmp_path / "plain" / "profile").exists()


@pytest.mark.multirank
def test_pipeline_step_reports_forward_and_backward_together(rank_pool, tmp_path, corpus_cache):
    args = tiny_args(tmp_path, corpus_cache, "pp", steps=2, extra=[
        "--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2", "--train.time_breakdown=true"])
    rank_pool.run(trainer_worker, 2, args=args)
    lines = train_lines(tmp_path / "pp")
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert "time_forward" not in r and r["time_forward_backward"] > 0
        assert r["time_optimizer"] >= 0 and r["time_comm_wait"] > 0
        assert r["time_forward_backward"] + r["time_optimizer"] + r["time_comm_wait"] <= 8 * 32 / r["tokens_per_s"]
