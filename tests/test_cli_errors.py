"""Bad input that used to end in a traceback, or inside the ranks: each is one sentence on stderr starting
``tessera: error:``, exit code 2, before any rank starts (no process group, no run folder)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.checkpoint import Piece, save_pieces, state_pieces
from tessera.cli import main
from tessera.comm.group import CommGroup
from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.models import Transformer
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config
from tessera.train.optim import build_optimizer
from tessera.train.rundir import resolve_run_dir

from test_trainer import tiny_args


def one_sentence(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: "), err
    assert "Traceback" not in err
    return lines[0]


def train(tmp_path, cache, *extra, nproc=2):
    """``tessera train`` of the tiny model on ``nproc`` local ranks; returns the exit code."""
    return main(["train", "--nproc", str(nproc), *tiny_args(tmp_path, cache, steps=2, extra=list(extra))])


# ---- numbers that are not finite ----------------------------------------------------------------


@pytest.mark.parametrize("extra, key", [
    (["--optim.lr=nan"], "optim.lr=nan"),
    (["--optim.grad_clip=inf"], "optim.grad_clip=inf"),
    (["--parallel.timeout_s=-inf"], "parallel.timeout_s=-inf"),
    (["--precision.loss_scale=inf"], "precision.loss_scale='inf'"),
    (["--model.norm_eps=inf"], "model.norm_eps=inf"),
    (["--model.rope_theta=nan"], "rope_theta"),  # the model's own check (nan is not positive) says it first
])
def test_a_non_finite_number_is_refused(tmp_path, corpus_cache, capsys, extra, key):
    assert train(tmp_path, corpus_cache, *extra) == 2
    line = one_sentence(capsys)
    assert key in line and ("not a finite number" in line or "must be positive" in line)
    assert not dist.is_initialized() and not any(tmp_path.iterdir())  # nothing started, nothing written


def test_a_non_finite_number_in_a_toml_file_is_refused(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('[model]\npreset = "tiny"\n[optim]\nweight_decay = nan\n[pipeline]\nlayer_costs = [1.0, inf]\n')
    assert main(["train", "--config", str(config), "--dry-run"]) == 2
    assert "optim.weight_decay=nan is not a finite number" in one_sentence(capsys)


# ---- a run folder that cannot be created ---------------------------------------------------------


@pytest.mark.parametrize("dry", [False, True])
def test_a_run_out_dir_that_cannot_be_created_is_refused(tmp_path, corpus_cache, capsys, dry):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    args = [f"--run.out_dir={blocker / 'runs'}", *(["--dry-run"] if dry else [])]
    assert train(tmp_path, corpus_cache, *args) == 2  # before the fix: rank 0's traceback, the others' PeerGoneError
    line = one_sentence(capsys)
    assert "run.out_dir" in line and str(blocker / "runs") in line and "cannot be created" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def run_dir_worker(rank, world_size, out_dir):
    """Under torchrun no launcher of ours runs first: rank 0 fails to create the folder, and every rank
    raises the same ConfigError instead of waiting for it."""
    cfg = load_config(None, ["--model.preset=tiny", f"--run.out_dir={out_dir}"])
    topology = Topology.build(ParallelConfig())
    try:
        resolve_run_dir(cfg, topology, torch.device("cpu"))
    except ConfigError as err:
        return str(err)
    finally:
        topology.destroy()
    return None


@pytest.mark.multirank
def test_ranks_agree_on_a_run_folder_that_cannot_be_created(rank_pool, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    errors = rank_pool.run(run_dir_worker, 2, out_dir=str(blocker / "runs"))
    assert errors[0] is not None and "cannot be created" in errors[0]
    assert errors[1] is not None and "cannot be created" in errors[1]


# ---- tessera export with a flag it does not know -------------------------------------------------


def test_export_refuses_unknown_flags(tmp_path, capsys):
    assert main(["export", str(tmp_path / "step_000001"), "--output", "w.safetensors"]) == 2
    assert "tessera export does not take --output" in one_sentence(capsys)


@pytest.mark.parametrize("argv, refused", [
    (["export", "ckpt", "--train.steps=3"], "tessera export does not take --train.steps=3"),
    (["plan", "--model", "llama3-8b", "--train.steps=3", "extra"], "tessera plan does not take --train.steps=3 extra"),
])
def test_only_train_takes_free_form_overrides(capsys, argv, refused):
    assert main(argv) == 2
    assert one_sentence(capsys) == f"tessera: error: {refused}; see {refused.split(' does')[0]} --help"


def test_a_usage_error_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export"])
    assert exit_.value.code == 2
    assert "the following arguments are required: checkpoint" in one_sentence(capsys)


# ---- a checkpoint whose optimizer state does not fit the job ------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, corpus_cache):
    """A real run's model config, and its checkpoint of 2 steps (model + AdamW state)."""
    out = tmp_path_factory.mktemp("saved")
    cfg = load_config(None, tiny_args(out, corpus_cache, steps=2, extra=["--run.name=good"]))
    run_rank(cfg)
    return cfg, out / "good" / "checkpoint" / "step_000002"


def save_edited(path, cfg, edit):
    """A checkpoint of the tiny model whose pieces ``edit(pieces) -> pieces`` changed, written by the real
    save path (manifest and checksums included, so only the content differs)."""
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    pieces = edit(state_pieces(model, optimizer))
    save_pieces(path, pieces, {"step": 2}, CommGroup.single())
    return path


def model_only(pieces):
    return [p for p in pieces if p.name.startswith("model/")]


def sgd_state(pieces):  # SGD with momentum keeps momentum_buffer where AdamW keeps exp_avg, exp_avg_sq, step
    return [*model_only(pieces), *(Piece.whole(p.name.replace("model/", "optim/", 1) + "/momentum_buffer",
                                               torch.zeros_like(p.tensor)) for p in model_only(pieces))]


def transposed_state(pieces):
    first = next(p for p in pieces if p.name.endswith("/exp_avg") and p.tensor.dim() == 2
                 and p.tensor.shape[0] != p.tensor.shape[1])
    return [p if p is not first else Piece.whole(p.name, p.tensor.t().contiguous()) for p in pieces]


@pytest.mark.parametrize("edit, words", [
    (model_only, "holds no optimizer state optim/"),
    (sgd_state, "holds no optimizer state optim/"),
    (transposed_state, "this job's optimizer state needs"),
])
def test_a_checkpoint_whose_optimizer_state_does_not_fit_is_refused_before_launch(
        tiny_model, tmp_path, corpus_cache, capsys, edit, words):
    cfg, _ = tiny_model
    bad = save_edited(tmp_path / "ckpt" / "step_000002", cfg, edit)
    assert train(tmp_path / "runs", corpus_cache, f"--checkpoint.resume={bad}") == 2
    line = one_sentence(capsys)
    assert words in line and str(bad / ".metadata") in line  # the file and the tensor, named
    assert not (tmp_path / "runs").exists()  # refused in this process: no rank, no run folder


def test_the_real_checkpoint_passes_the_same_check(tiny_model, tmp_path, corpus_cache, capsys):
    _, good = tiny_model
    assert train(tmp_path, corpus_cache, f"--checkpoint.resume={good}", "--dry-run") == 0
    assert f"resume:     {good}" in capsys.readouterr().out
