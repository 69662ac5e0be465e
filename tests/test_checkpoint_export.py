"""A checkpoint saved by 4 ranks as one safetensors file: the plain single-process state_dict."""

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tessera.checkpoint import CheckpointError, export_command, export_safetensors
from tessera.checkpoint.manifest import MANIFEST

from test_checkpoint_store import original, saved4  # noqa: F401 - saved4 is a fixture


@pytest.mark.multirank
def test_export_assembles_the_pieces_of_4_ranks(saved4, tmp_path):  # noqa: F811
    out = export_safetensors(saved4, tmp_path / "out" / "model.safetensors")
    exported, want = load_file(out), original()
    assert sorted(exported) == ["v", "w"]  # model/ only, without the prefix
    for name, t in exported.items():
        assert t.dtype == want["model/" + name].dtype and torch.equal(t, want["model/" + name])
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["step"] == "17"
    optim = load_file(export_safetensors(saved4, tmp_path / "optim.safetensors", prefix="optim/"))
    assert torch.equal(optim["m"], want["optim/m"]) and int(optim["step"]) == 17


@pytest.mark.multirank
def test_export_command_takes_the_newest_of_a_folder(saved4, tmp_path, capsys):  # noqa: F811
    for name in ("step_000005", "step_000017"):
        shutil.copytree(saved4, tmp_path / name)
    assert export_command(str(tmp_path)) == 0
    out = tmp_path / "step_000017.safetensors"
    assert out.is_file() and str(out) in capsys.readouterr().out
    assert torch.equal(load_file(out)["w"], original()["model/w"])
    copy = tmp_path / "step_000017"  # the checkpoint itself is untouched
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in saved4.iterdir())
    assert (copy / MANIFEST).read_bytes() == (saved4 / MANIFEST).read_bytes()


def test_export_errors_name_the_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="step_000003"):
        export_safetensors(tmp_path / "step_000003", tmp_path / "x.safetensors")
