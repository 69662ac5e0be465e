"""The memory check before launch (``run.check_memory``, tessera.train.memory_check): a job whose predicted
peak memory per rank exceeds what this machine gives each local rank is refused with one sentence and
exit code 2 before any rank starts, naming a layout that fits by the same prediction; the test suite's and
the docs' own jobs are never refused on the CI machine (24 GB, 2 cores)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.cli import build_parser, main, resolve_job, with_demo_layout
from tessera.errors import ConfigError
from tessera.planner import Layout, from_model_config
from tessera.planner.estimate import stage_memory
from tessera.planner.machine import PROCESS_BYTES, host_memory_bytes, usable_per_rank
from tessera.planner.memory import DISK_STAGING_BYTES
from tessera.train import memory_check
from tessera.train.config import load_config, validate_config
from tessera.train.memory_check import Budget, check_memory, memory_report, predicted_peak

ROOT = Path(__file__).resolve().parent.parent
CI_RAM = 22e9  # RAM available on an idle 24 GB machine, less the launcher and the desktop around it
GB = 1e9


def job(*flags: str, world: int = 2):
    cfg = load_config(None, [*flags, f"--run.nproc={world}"])
    validate_config(cfg, world)
    return cfg, cfg.parallel.resolved(world)


def budget_for(need: float, local_ranks: int = 2) -> Budget:
    """A machine whose usable memory per rank is just ``need`` bytes."""
    per_rank = need / usable_per_rank(1.0)
    return Budget(per_rank, local_ranks, f"{per_rank * local_ranks / GB:.1f} GB of RAM available (test)", True)


SMALL_DDP = ("--model.preset=small", "--parallel.dp_replicate=2", "--data.global_batch_size=8")


def test_a_job_over_the_memory_is_refused_with_a_layout_that_fits():
    cfg, par = job(*SMALL_DDP)
    need = predicted_peak(cfg, par)
    budget = budget_for(need * 0.97)  # a few percent short: ZeRO sharding brings it under
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, par, 2, budget)
    message = str(err.value)
    assert f"{need / GB:.1f} GB (dp=2 mb=4)" in message and "run.check_memory=false skips" in message
    assert "\n" not in message
    flags = re.search(r"a layout of 2 ranks that fits is (.*?) \(", message).group(1).split()
    assert flags and all(f.startswith("--") for f in flags)
    fixed, fixed_par = job(*SMALL_DDP, *flags)  # the named layout runs, as typed, and fits by the same rule
    assert predicted_peak(fixed, fixed_par) <= budget.usable
    check_memory(fixed, fixed_par, 2, budget)


def test_the_prediction_is_the_dry_runs_plus_a_process_and_the_host():
    cfg, par = job(*SMALL_DDP, "--parallel.zero_stage=3", "--precision.dtype=bf16")
    spec = from_model_config(cfg.model_preset, cfg.model)
    mem, host = stage_memory(spec, Layout(dp=2, zero_stage=3, micro_batch=4), 8, cfg.data.seq_len, "mixed", "adam", 0)
    assert predicted_peak(cfg, par) == pytest.approx(mem["total"] + host + PROCESS_BYTES)
    assert predicted_peak(cfg, par, on_cpu=False) == pytest.approx(mem["total"])  # a device holds no process


def test_disk_offload_keeps_only_staging_buffers_in_memory():
    spec = from_model_config("7B", load_config(None, ["--model.preset=7B", "--model.n_layers=8",
                                                      "--model.vocab_size=256"]).model)
    kept = {}
    for offload in (False, True, "disk"):
        mem, host = stage_memory(spec, Layout(dp=2, zero_stage=3, offload=offload), 2, 64, "mixed", "adam", 0)
        kept[offload] = (mem, host)
    assert kept["disk"][0]["optimizer"] == 0 and kept["disk"][1] == DISK_STAGING_BYTES
    assert kept[True][1] == pytest.approx((12 + 4) * spec.num_params() / 2)  # host: states and fp32 grads
    # on the CPU the host is the same RAM: only disk offload makes the rank smaller
    resident = {k: m["total"] + h for k, (m, h) in kept.items()}
    assert resident["disk"] < resident[False] / 2 and resident[True] == pytest.approx(resident[False], rel=0.01)


def test_the_issue_7b_command_is_refused_here_and_fits_with_disk_offload():
    """The issue's 7B command on this machine's RAM (24 GB): refused without offload, not with disk offload."""
    flags = ("--model.preset=7B", "--model.n_layers=8", "--model.vocab_size=256", "--parallel.zero_stage=3",
             "--precision.dtype=bf16", "--train.steps=2", "--data.seq_len=64", "--data.global_batch_size=2",
             "--data.micro_batch_size=1")
    budget = Budget(CI_RAM / 2, 2, "22 GB of RAM available (test)", True)
    cfg, par = job(*flags)
    with pytest.raises(ConfigError, match="a layout of 2 ranks that fits is"):
        check_memory(cfg, par, 2, budget)
    disk, disk_par = job(*flags, "--zero.offload=disk")
    check_memory(disk, disk_par, 2, budget)
    assert predicted_peak(disk, disk_par) < 0.6 * predicted_peak(cfg, par)


def test_no_layout_of_the_world_size_fits_says_what_would():
    cfg, par = job("--model.preset=1B", "--model.n_layers=2", "--model.vocab_size=256", "--data.seq_len=64",
                   "--data.global_batch_size=8", "--data.micro_batch_size=1", "--parallel.dp_replicate=2")
    budget = budget_for(0.7 * GB)  # 0.35 GB beside the process: no layout of 2 ranks holds 122M fp32 parameters
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, par, 2, budget)
    message = str(err.value)
    assert "no layout of 2 ranks fits" in message or "nor on up to" in message, message
    tiny = budget_for(0.8 * PROCESS_BYTES, local_ranks=8)  # not even an empty process fits
    small, small_par = job("--model.preset=tiny", "--data.micro_batch_size=1", world=8)
    with pytest.raises(ConfigError, match="room for at most 6 local ranks"):
        check_memory(small, small_par, 8, tiny)


def test_check_memory_false_skips_the_check():
    cfg, par = job(*SMALL_DDP, "--run.check_memory=false")
    check_memory(cfg, par, 2, budget_for(1.0))  # one byte per rank, and no refusal
    assert memory_report(cfg, par, 2, budget_for(1.0)) == "memory check: off (run.check_memory=false)"


def test_the_cli_refuses_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    """In process, with this machine's RAM made small: exit 2, one sentence, no run folder, no launch."""
    launched = []
    monkeypatch.setattr("tessera.cli._launch", lambda *args: launched.append(args) or {})
    monkeypatch.setattr(memory_check, "host_memory_bytes", lambda: 2 * 0.4e9)  # 0.4 GB per rank
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    args = ["train", "--nproc", "2", *SMALL_DDP, f"--run.out_dir={tmp_path / 'runs'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera: error: a rank's predicted peak memory") and len(err.splitlines()) == 1
    assert not launched and not (tmp_path / "runs").exists()
    assert main([*args, "--run.check_memory=false"]) == 0 and len(launched) == 1  # skipped: it launches
    capsys.readouterr()
    assert main([*args, "--dry-run"]) == 0  # a dry run shows the verdict and refuses nothing
    assert "memory check: a rank's predicted peak" in capsys.readouterr().out
    assert len(launched) == 1


def test_a_real_process_exits_2_before_any_rank(tmp_path):
    """The console entry point, as a user runs it: the 70B preset on 2 local ranks fits no machine."""
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--nproc", "2", "--model.preset=70B",
                           f"--run.out_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("tessera: error: a rank's predicted peak memory") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


def _documented_train_jobs() -> list[list[str]]:
    from test_docs_commands import DOCS, commands

    # a --model.hf job names a folder test_docs_commands exports first (the small preset's run r1, whose
    # shape the presets below cover)
    return [tokens[tokens.index("train") + 1:] for doc in DOCS for tokens in commands(doc.read_text())
            if tokens[0] == "tessera" and tokens[1:2] == ["train"]
            and not any(t.startswith("--model.hf=") for t in tokens)]


def _resolved(argv: list[str]):
    args, rest = build_parser().parse_known_args(["train", *argv])
    overrides = [*rest, *([f"--run.nproc={args.nproc}"] if args.nproc is not None else [])]
    cfg = load_config(str(ROOT / args.config) if args.config else None, with_demo_layout(args, overrides))
    cfg.checkpoint.resume = ""  # the folders the docs resume from, their corpus and tokenizer, are made by
    cfg.data.corpus = "stdlib"  # test_docs_commands; none changes the memory of a rank
    cfg.data.tokenizer = "byte"
    return cfg


def test_the_docs_and_test_suite_jobs_fit_a_24_gb_machine(monkeypatch):
    """Every ``tessera train`` job of README.md and docs/ on at most 8 local ranks (the demo's; the docs'
    64- and 1024-rank examples are dry-runs of a layout for a bigger cluster), the configs/ files, and
    the presets the test suite trains, at 1 to 8 ranks: none is refused on 22 GB of available RAM."""
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    jobs = [argv for argv in _documented_train_jobs() if "--dry-run" not in argv]
    jobs += [["--config", str(p.relative_to(ROOT))] for p in sorted((ROOT / "configs").glob("*.toml"))]
    jobs += [[f"--nproc={n}", f"--model.preset={p}", "--data.micro_batch_size=2"] for p in ("tiny", "small", "moe-small") for n in (1, 2, 4, 8)]
    checked = 0
    for argv in jobs:
        cfg = _resolved(argv)
        if cfg.model_preset == "ctr" or cfg.run.nproc > 8:
            continue
        par = resolve_job(cfg, cfg.run.nproc, announce=False)
        budget = Budget(CI_RAM / cfg.run.nproc, cfg.run.nproc, "22 GB (test)", True)
        assert memory_check.memory_verdict(cfg, par, cfg.run.nproc, budget) is None, shlex.join(argv)
        checked += 1
    assert checked >= 20


def test_host_memory_is_read_from_the_machine():
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < host_memory_bytes() <= total
