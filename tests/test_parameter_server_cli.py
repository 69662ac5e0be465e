"""``tessera train --model.preset=ctr --ps.*``: the parameter-server job from the command line."""

import json

import pytest

from tessera.cli import main


@pytest.mark.slow
def test_cli_runs_an_ssp_job(tmp_path, capsys):
    args = ["train", "--model.preset=ctr", "--ps.servers=2", "--ps.workers=2", "--ps.mode=ssp",
            "--ps.staleness=2", "--train.steps=6", f"--run.out_dir={tmp_path}", "--ps.buckets=100",
            "--ps.batch_size=32", "--ps.eval_size=512", "--run.progress=false"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "ssp" and report["steps"] == 6 and 0.0 < report["auc"] < 1.0
    assert report["max_gap"] <= 2
    run = tmp_path / "ctr-ps2-w2-ssp"
    assert (run / "config.toml").is_file() and (run / "summary.json").is_file()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 6
    assert sorted(p.name for p in (run / "tables" / "step_0000006").iterdir()) == ["ps0.pt", "ps1.pt"]


def test_cli_bad_ps_value_is_one_sentence(capsys):
    assert main(["train", "--model.preset=ctr", "--ps.mode=sync"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tessera: error: ps.mode must be one of bsp, asp, ssp, got 'sync'"
