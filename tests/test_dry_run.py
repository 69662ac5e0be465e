"""``tessera train --dry-run``: every check of a launch, then the layout, run folder, each rank's role and
the planner's memory per rank; nothing started (no rank, no process group) and nothing written. Also:
every preset gives a valid configuration at its defaults (its data settings fit it)."""

from __future__ import annotations

import ast
import re

import pytest
import torch.distributed as dist

from tessera.cli import main
from tessera.errors import ConfigError
from tessera.models.config import PRESETS
from tessera.planner import Layout, from_model_config, memory_per_rank
from tessera.planner.estimate import stage_memory
from tessera.topology import ParallelConfig
from tessera.train.config import load_config, validate_config
from tessera.train.dry_run import SHOWN_RANKS, planner_layout, predicted_memory, rank_roles


def dry_run(tmp_path, capsys, *args) -> str:
    assert main(["train", "--dry-run", f"--run.out_dir={tmp_path / 'runs'}", *args]) == 0
    out = capsys.readouterr().out
    assert not dist.is_initialized()  # no process group was made
    assert not any(tmp_path.iterdir())  # and nothing was written
    return out


def rank_rows(out: str) -> list[list[str]]:
    table = out[out.index("ranks (coordinate"):].splitlines()[2:]
    return [line.split() for line in table if line.strip() and not line.strip().startswith("…")]


def test_the_demo_dry_run_shows_the_3d_layout(tmp_path, capsys, monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = dry_run(tmp_path, capsys)
    assert "layout:     8 rank(s): pp=2 dp_replicate=2 tp=2" in out
    assert f"run folder: {tmp_path / 'runs' / 'small-pp2-dpr2-tp2'}" in out
    rows = rank_rows(out)
    assert [r[:6] for r in rows] == [[str(rank), str(rank // 4), str(rank // 2 % 2), "0", "0", str(rank % 2)]
                                     for rank in range(8)]  # order pp-dp_replicate-dp_shard-cp-tp, tp fastest
    assert len({r[-1] for r in rows[:4]}) == 1 and rows[0][-1] != rows[4][-1]  # memory differs by stage


def test_any_world_size_dry_runs_in_one_process(tmp_path, capsys):
    out = dry_run(tmp_path, capsys, "--nproc", "64", "--parallel.tp=4", "--parallel.pp=2",
                  "--data.global_batch_size=64")
    assert "64 rank(s): pp=2 dp_replicate=8 tp=4" in out and len(rank_rows(out)) == 64
    big = dry_run(tmp_path, capsys, "--nproc", "1024", "--model.preset=70B", "--parallel.tp=8",
                  "--parallel.pp=8", "--data.global_batch_size=64", "--data.micro_batch_size=1")
    rows = rank_rows(big)
    assert len(rows) == SHOWN_RANKS and rows[-1][0] == "1023"  # condensed: first and last ranks
    assert f"… {1024 - SHOWN_RANKS} more ranks" in big
    stages = re.findall(r"^\s+(\d+)(?:\s+[\d.]+){6}$", big[big.index("predicted"):big.index("ranks (")], re.M)
    assert stages == [str(s) for s in range(8)]  # one memory row per pipeline stage, in GB
    assert "(GB, planner" in big


def test_the_memory_per_rank_is_the_planners():
    cfg = load_config(None, ["--model.preset=7B", "--parallel.pp=4", "--parallel.tp=2",
                             "--data.global_batch_size=64", "--data.micro_batch_size=1"])
    par = validate_config(cfg, 64).parallel.resolved(64)
    layout, batch, _ = planner_layout(cfg, par)
    assert layout == Layout(dp=8, pp=4, tp=2, micro_batch=2, schedule="1f1b")  # 8 per dp rank in 4 micro-batches
    spec = from_model_config("7B", cfg.model)
    stages, _ = predicted_memory(cfg, par)
    assert stages == [stage_memory(spec, layout, batch, cfg.data.seq_len, "fp32", "adam", s)[0] for s in range(4)]
    first = stages[0]
    assert max(s["total"] for s in stages) == memory_per_rank(spec, layout, batch, cfg.data.seq_len, "fp32")[0]["total"]
    # a middle stage holds its layers' states and fewer micro-batches in flight than the first (1F1B)
    acts = [s["activations"] for s in stages]
    assert stages[1]["params"] < first["params"] and acts[3] < acts[2] < acts[1] < acts[0]


def test_expert_axes_appear_when_experts_are_sharded():
    axes, rows = rank_roles(ParallelConfig(dp_replicate=4, tp=2, ep=2))
    assert axes == ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "edp")
    # dp index d = edp·ep + ep: ranks 0,1 (tp peers) are ep 0 edp 0; ranks 2,3 ep 1 edp 0; ranks 4,5 ep 0 edp 1
    assert [row[5:] for row in rows] == [(0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]


def test_a_dry_run_under_torchrun_prints_on_rank_0_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert "4 rank(s): dp_replicate=4" in dry_run(tmp_path, capsys)
    monkeypatch.setenv("RANK", "3")
    assert dry_run(tmp_path, capsys) == ""


def test_a_dry_run_under_torchrun_reads_the_checkpoint_on_rank_0_only(tmp_path, capsys, monkeypatch):
    from tessera.train import resume

    calls = []
    monkeypatch.setattr(resume, "check_before_launch", lambda cfg: calls.append(cfg) or None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank in ("3", "0"):
        monkeypatch.setenv("RANK", rank)
        dry_run(tmp_path, capsys)
    assert len(calls) == 1  # rank 3 checked everything else, but hashed no checkpoint


def test_a_ctr_job_under_torchrun_is_refused_by_the_dry_run_and_the_run_alike(tmp_path, capsys, monkeypatch):
    for var, value in (("TORCHELASTIC_RUN_ID", "ctr-test"), ("RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(var, value)
    for mode in (["--dry-run"], []):
        assert main(["train", "--model.preset=ctr", f"--run.out_dir={tmp_path / 'runs'}", *mode]) == 2
        err = capsys.readouterr().err.strip()
        assert err == ("tessera: error: the parameter-server mode (model.preset=ctr) starts its own processes: "
                       "run it without torchrun")
    assert not any(tmp_path.iterdir())  # refused before the run folder was made


def test_parallel_auto_is_resolved_in_the_dry_run(tmp_path, capsys):
    assert main(["train", "--dry-run", "--nproc", "4", "--model.preset=tiny", "--parallel.auto=true",
                 f"--run.out_dir={tmp_path}"]) == 0
    captured = capsys.readouterr()
    chosen = ast.literal_eval(captured.err[captured.err.index("{"):captured.err.index("}") + 1])
    shown = " ".join(f"{a}={chosen[a]}" for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if chosen[a] > 1)
    assert f"layout:     4 rank(s): {shown}; zero_stage={chosen['zero_stage']}" in captured.out


def test_a_dry_run_refuses_what_a_launch_refuses(tmp_path, capsys):
    assert main(["train", "--dry-run", "--nproc", "3"]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert main(["train", "--dry-run", "--checkpoint.resume=" + str(tmp_path)]) == 2  # a folder, no checkpoint
    assert "neither a complete checkpoint nor a folder holding one" in capsys.readouterr().err


# ---- presets and their data settings -------------------------------------------------------------


@pytest.mark.parametrize("preset", [*PRESETS, "ctr"])
def test_every_preset_is_valid_at_its_defaults(tmp_path, capsys, preset):
    cfg = validate_config(load_config(None, [f"--model.preset={preset}"]), 2)
    if preset != "ctr":
        assert cfg.data.seq_len == min(128, cfg.model.max_seq_len)
    out = dry_run(tmp_path, capsys, f"--model.preset={preset}")
    assert "every check passed" in out


def test_the_readme_one_process_command_fits_the_tiny_model(tmp_path, capsys):
    """`tessera train --nproc 1 --model.preset=tiny` used to exit 2 (seq_len 128 > max_seq_len 64)."""
    out = dry_run(tmp_path, capsys, "--nproc", "1", "--model.preset=tiny")
    assert "x 64 tokens per step" in out and "1 rank(s): one process" in out
    with pytest.raises(ConfigError, match="data.seq_len=128 exceeds model.max_seq_len=64"):
        validate_config(load_config(None, ["--model.preset=tiny", "--data.seq_len=128"]), 1)
