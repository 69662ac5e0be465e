"""`tessera train` with no layout of its own runs the 3D-parallel demo: dp2 x tp2 x pp2 on 8 ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.cli import DEMO_LAYOUT, build_parser, with_demo_layout

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv,demo", [
    (["train"], True),
    (["train", "--train.steps=5", "--data.seq_len=64"], True),
    (["train", "--nproc", "2"], False),
    (["train", "--config", "configs/tiny.toml"], False),
    (["train", "--parallel.tp=2"], False),
    (["train", "--run.nproc=4"], False),
    (["train", "--model.preset=moe-small"], False),
])
def test_the_demo_layout_applies_only_when_no_layout_was_chosen(argv, demo, monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    args, rest = build_parser().parse_known_args(argv)
    assert with_demo_layout(args, rest) == ([*DEMO_LAYOUT, *rest] if demo else rest)


@pytest.mark.slow
def test_tessera_train_without_arguments_runs_the_3d_demo(tmp_path, corpus_cache):
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "train", "--train.steps=2", "--train.eval_every=2",
         "--data.eval_batches=1", f"--data.cache_dir={corpus_cache}", f"--run.out_dir={tmp_path}",
         "--run.progress=false", "--checkpoint.save_final=false"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["layout"].startswith("8 rank(s): pp=2 dp_replicate=2 tp=2")
    assert summary["val_loss_end"] < summary["val_loss_start"]
