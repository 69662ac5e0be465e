"""Bad checkpoints given to `tessera train --checkpoint.resume=…` and `tessera export` from the command
line: one sentence naming the file, exit code 2, before any rank starts, the checkpoint untouched."""

import shutil

import pytest
from safetensors.torch import load_file

from tessera.checkpoint.manifest import sha256
from tessera.cli import main
from tessera.launch import run_rank
from tessera.models import Transformer
from tessera.train.config import load_config

from test_trainer import tiny_args


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus_cache):
    out = tmp_path_factory.mktemp("saved")
    cfg = load_config(None, tiny_args(out, corpus_cache, steps=2, extra=["--run.name=good"]))
    run_rank(cfg)
    return out, out / "good" / "checkpoint" / "step_000002", cfg


def fingerprint(folder):
    return {p.name: sha256(p) for p in sorted(folder.iterdir()) if p.is_file()}


def train_cli(tmp_path, corpus_cache, resume, extra=()):
    return main(["train", "--nproc", "1",
                 *tiny_args(tmp_path, corpus_cache, steps=3, extra=[f"--checkpoint.resume={resume}", *extra])])


def damaged(saved_path, tmp_path, how):
    bad = tmp_path / "bad"
    shutil.copytree(saved_path, bad)
    shard = next(p for p in sorted(bad.iterdir()) if p.suffix == ".distcp")
    if how == "missing":
        shard.unlink()
    else:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    return bad, shard


@pytest.mark.parametrize("how,words", [("missing", "is missing"), ("corrupted", "does not match its checksum")])
def test_a_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path, corpus_cache, capsys, how, words):
    _, path, _ = saved
    bad, shard = damaged(path, tmp_path, how)
    before = fingerprint(path)
    assert train_cli(tmp_path, corpus_cache, bad) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(shard) in err and words in err
    assert fingerprint(path) == before and not (tmp_path / "tiny-single").exists()  # no run was started


def test_a_checkpoint_of_another_model_is_refused(saved, tmp_path, corpus_cache, capsys):
    _, path, _ = saved
    assert train_cli(tmp_path, corpus_cache, path, ["--model.dim=64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "another model" in err


def test_export_writes_single_process_weights(saved, tmp_path, capsys):
    _, path, cfg = saved
    out = tmp_path / "weights.safetensors"
    assert main(["export", str(path), "--out", str(out)]) == 0
    weights = load_file(str(out))
    assert sorted(weights) == sorted(n for n, _ in Transformer(cfg.model).named_parameters())
    bad, shard = damaged(path, tmp_path, "corrupted")
    assert main(["export", str(bad)]) == 2 and str(shard) in capsys.readouterr().err
