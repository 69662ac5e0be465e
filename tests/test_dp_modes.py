"""Data-parallel modes from the command line (``ddp.mode``, tessera.train.dp_modes).

Synchronous modes equal one process: the rank-0 and the sharded parameter server at dp2 (losses, gradient
norms, validation losses and final parameters), with tensor and context parallelism, DataParallel and
CentralStorage in one process over two CPU "devices", and local SGD averaging after every plain SGD step.
Local SGD every k steps is tested for its defined semantics: replicas differ between averages, agree
exactly at steps k, 2k, and the average is the mean of the replicas. Each refusal is one sentence from
``tessera train --dry-run`` with exit code 2.
"""

from __future__ import annotations

import json

import pytest
import torch

from tessera.cli import main
from tessera.train.config import load_config
from tessera.train.trainer import Trainer

from test_trainer import tiny_args
from test_trainer_strategies import assert_tracks_fp32

MODEL = ["--model.n_layers=2", "--checkpoint.save_final=false", "--train.log_every=1"]
DEVICES = '--ddp.devices=["cpu", "cpu"]'


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def mode_worker(rank, world_size, args):
    """Train; (summary, this rank's final parameters [P] in fp32)."""
    trainer = Trainer(load_config(None, args), torch.device("cpu"))
    try:
        return trainer.fit(), flat_params(trainer.core)
    finally:
        trainer.close()


def local_sgd_worker(rank, world_size, args, steps):
    """Step by step: this replica's parameters after every step, and before each average."""
    trainer = Trainer(load_config(None, args), torch.device("cpu"))
    before, after = {}, []
    local = trainer.mode.local
    average = local.after_step

    def recording():
        if (local.steps + 1) % local.every == 0:
            before[local.steps + 1] = flat_params(trainer.core)
        return average()

    local.after_step = recording
    try:
        for step in range(1, steps + 1):
            trainer.step_once(step)
            after.append(flat_params(trainer.core))
    finally:
        trainer.close()
    return before, after


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """``get(name, *extra) -> (summary, params, metrics)`` of one process, made once per name."""
    out, done = tmp_path_factory.mktemp("dp_modes_ref"), {}

    def get(name, *extra):
        if name not in done:
            args = tiny_args(out, corpus_cache, steps=3, extra=[*MODEL, *extra, f"--run.name={name}"])
            summary, params = mode_worker(0, 1, args)
            done[name] = summary, params, metrics(out / name)
        return done[name]

    return get


def assert_equal_runs(ref, got, summary, params):
    """Same logged losses and gradient norms, validation losses and final parameters as one process."""
    ref_summary, ref_params, ref_metrics = ref
    for key in ("val_loss_start", "val_loss_end", "train_loss_end"):
        assert summary[key] == pytest.approx(ref_summary[key], rel=1e-5), key
    train = [(r["loss"], r["grad_norm"]) for r in ref_metrics if r["kind"] == "train"]
    mine = [(r["loss"], r["grad_norm"]) for r in got if r["kind"] == "train"]
    assert len(mine) == len(train) == 3
    for (a, na), (b, nb) in zip(train, mine):
        assert b == pytest.approx(a, rel=1e-5) and nb == pytest.approx(na, rel=1e-4)
    if params is not None:
        torch.testing.assert_close(params, ref_params, rtol=1e-4, atol=1e-6)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["ps-rank0", "ps-sharded"])
def test_parameter_server_matches_single_process(rank_pool, tmp_path, corpus_cache, references, mode):
    args = tiny_args(tmp_path, corpus_cache, steps=3, extra=[*MODEL, f"--ddp.mode={mode}", "--run.name=ps"])
    results = rank_pool.run(mode_worker, 2, args=args)
    assert_equal_runs(references("fp32"), metrics(tmp_path / "ps"), *results[0])
    assert torch.equal(results[0][1], results[1][1])  # every worker holds the served parameters
    comm = metrics(tmp_path / "ps")[1]["comm_per_step"]
    assert any(("gather" if mode == "ps-rank0" else "reduce_scatter") in key for key in comm), comm


@pytest.mark.multirank
@pytest.mark.parametrize("mode, layout", [("ps-sharded", "--parallel.tp=2"), ("ps-rank0", "--parallel.cp=2")])
def test_parameter_server_with_tp_or_cp_matches_single_process(rank_pool, tmp_path, corpus_cache, references,
                                                                mode, layout):
    args = tiny_args(tmp_path, corpus_cache, steps=3, extra=[*MODEL, f"--ddp.mode={mode}", layout, "--run.name=x"])
    results = rank_pool.run(mode_worker, 4, args=args)
    summary, params = results[0]
    # a tp rank holds slices of the parameters: there the run is compared, not the parameter vector
    assert_equal_runs(references("fp32"), metrics(tmp_path / "x"), summary, None if "tp" in layout else params)


@pytest.mark.parametrize("mode", ["dataparallel", "central-storage"])
def test_single_process_modes_match_single_process(tmp_path, corpus_cache, references, mode):
    args = tiny_args(tmp_path, corpus_cache, steps=3, extra=[*MODEL, f"--ddp.mode={mode}", DEVICES, "--run.name=m"])
    summary, params = mode_worker(0, 1, args)
    assert_equal_runs(references("fp32"), metrics(tmp_path / "m"), summary, params)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["ps-rank0", "ps-sharded", "local-sgd"])
def test_low_precision_modes_track_fp32(rank_pool, tmp_path, corpus_cache, references, mode):
    """bf16 with fp32 masters: the rank-0 server's own, the sharded server's engine, a ZeRO-0 engine per
    local-SGD replica (which averages the masters; with SGD every step, to compare with one process)."""
    sgd = ["--optim.name=sgd", "--optim.grad_clip=0", "--ddp.average_every=1"] if mode == "local-sgd" else []
    ref = references("sgd", *sgd[:2])[2] if sgd else references("fp32")[2]
    args = tiny_args(tmp_path, corpus_cache, steps=3, extra=[*MODEL, "--precision.dtype=bf16", f"--ddp.mode={mode}",
                                                             *sgd, "--run.name=low"])
    rank_pool.run(mode_worker, 2, args=args)
    assert_tracks_fp32(ref, metrics(tmp_path / "low"), f"{mode} bf16", min_logs=3)


def test_dataparallel_in_bf16_tracks_fp32(tmp_path, corpus_cache, references):
    ref = references("fp32")[2]
    args = tiny_args(tmp_path, corpus_cache, steps=3, extra=[*MODEL, "--precision.dtype=bf16",
                                                             "--ddp.mode=dataparallel", DEVICES, "--run.name=dp"])
    mode_worker(0, 1, args)
    assert_tracks_fp32(ref, metrics(tmp_path / "dp"), "dataparallel bf16", min_logs=3)


@pytest.mark.multirank
def test_local_sgd_every_step_with_sgd_matches_single_process(rank_pool, tmp_path, corpus_cache, references):
    """Averaging after each plain SGD step = stepping with the averaged gradient (no clipping: local SGD
    clips by each replica's own norm, documented)."""
    sgd = ["--optim.name=sgd", "--optim.grad_clip=0"]
    args = tiny_args(tmp_path, corpus_cache, steps=3, extra=[*MODEL, *sgd, "--ddp.mode=local-sgd",
                                                             "--ddp.average_every=1", "--run.name=ls"])
    results = rank_pool.run(mode_worker, 2, args=args)
    ref_summary, ref_params, ref_metrics = references("sgd", *sgd)
    got = metrics(tmp_path / "ls")
    assert [r["loss"] for r in got if r["kind"] == "train"] == pytest.approx(
        [r["loss"] for r in ref_metrics if r["kind"] == "train"], rel=1e-5)
    assert results[0][0]["val_loss_end"] == pytest.approx(ref_summary["val_loss_end"], rel=1e-5)
    for _, params in results:
        torch.testing.assert_close(params, ref_params, rtol=1e-4, atol=1e-6)


@pytest.mark.multirank
def test_local_sgd_sums_gradients_over_cp_like_one_process(rank_pool, tmp_path, corpus_cache, references):
    """One replica split over two cp ranks: their gradients summed (one flat all-reduce) every step."""
    sgd = ["--optim.name=sgd", "--optim.grad_clip=0"]
    args = tiny_args(tmp_path, corpus_cache, steps=3, extra=[*MODEL, *sgd, "--ddp.mode=local-sgd",
                                                             "--parallel.cp=2", "--run.name=lcp"])
    results = rank_pool.run(mode_worker, 2, args=args)
    assert_equal_runs(references("sgd", *sgd), metrics(tmp_path / "lcp"), *results[0])


@pytest.mark.multirank
def test_local_sgd_replicas_agree_exactly_at_every_average(rank_pool, tmp_path, corpus_cache):
    args = tiny_args(tmp_path, corpus_cache, steps=4, extra=[*MODEL, "--ddp.mode=local-sgd",
                                                             "--ddp.average_every=2", "--run.name=k2"])
    (before0, after0), (before1, after1) = rank_pool.run(local_sgd_worker, 2, args=args, steps=4)
    for step in (1, 3):  # between averages each replica followed its own batches
        assert not torch.equal(after0[step - 1], after1[step - 1])
    for step in (2, 4):  # at k, 2k: one all-reduce made them equal, to the mean of the replicas
        assert torch.equal(after0[step - 1], after1[step - 1])
        assert not torch.equal(before0[step], before1[step])
        torch.testing.assert_close(after0[step - 1], (before0[step] + before1[step]) / 2, rtol=0, atol=1e-7)


@pytest.mark.multirank
def test_parameter_server_resumes_from_a_checkpoint(rank_pool, tmp_path, corpus_cache):
    """The rank-0 server's optimizer state is its own parameters' (rank 0's pieces): resuming at step 2 of 4
    ends where the uninterrupted run ends."""
    common = ["--model.n_layers=2", "--train.log_every=1", "--ddp.mode=ps-rank0"]
    whole = tiny_args(tmp_path, corpus_cache, steps=4, extra=[*common, "--checkpoint.every=2", "--run.name=a"])
    first = rank_pool.run(mode_worker, 2, args=whole)
    resumed = tiny_args(tmp_path, corpus_cache, steps=4, extra=[
        *common, f"--checkpoint.resume={tmp_path / 'a' / 'checkpoint' / 'step_000002'}", "--run.name=b"])
    second = rank_pool.run(mode_worker, 2, args=resumed)
    assert second[0][0]["resumed_from_step"] == 2
    assert second[0][0]["train_loss_end"] == pytest.approx(first[0][0]["train_loss_end"], rel=1e-6)
    torch.testing.assert_close(second[1][1], first[1][1], rtol=1e-6, atol=1e-7)


REFUSALS = [
    (2, ["--ddp.mode=ps-sharded", "--parallel.zero_stage=1"], "ZeRO"),
    (2, ["--ddp.mode=local-sgd", "--model.num_experts=2", "--parallel.ep=2"], "different experts"),
    (4, ["--ddp.mode=ps-rank0", "--parallel.pp=2", "--pipeline.schedule=pipedream"], "pipedream"),
    (4, ["--ddp.mode=ps-rank0", "--ddp.consistency=async", "--parallel.pp=2"], "one weight version within a step"),
    (2, ["--ddp.mode=ps-rank0", "--precision.dtype=bf16", "--checkpoint.every=2"], "fp32 masters"),
    (2, ["--ddp.mode=dataparallel", DEVICES], "one rank"),
    (1, ["--ddp.mode=central-storage"], "ddp.devices"),
    (2, ["--ddp.mode=local-sgd", "--parallel.tp=2"], "has one"),
    (2, ["--ddp.mode=local-sgd", "--checkpoint.every=2"], "checkpoint"),
    (2, ["--ddp.mode=gossip"], "must be one of"),
    (2, ["--ddp.average_every=2"], "no effect"),
    (2, ["--ddp.mode=ps-rank0", DEVICES], "no effect"),
    (2, ["--ddp.mode=local-sgd", "--ddp.consistency=ssp"], "parameter-server modes"),
    (2, ["--ddp.mode=ps-sharded", "--ddp.bucket_mb=5"], "exchanges at the step"),
    (2, ["--ddp.mode=ps-sharded", "--zero.offload=host"], "zero_stage"),  # offload is ZeRO-1/2/3's
]


@pytest.mark.parametrize("nproc, extra, says", REFUSALS)
def test_mode_refusals_are_one_sentence_before_launch(tmp_path, corpus_cache, capsys, nproc, extra, says):
    code = main(["train", "--nproc", str(nproc), "--dry-run", *tiny_args(tmp_path, corpus_cache, extra=extra)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("tessera: error: ") and says in err[0], err


@pytest.mark.multirank
def test_local_sgd_trains_logs_and_checkpoints_end_to_end(rank_pool, tmp_path, corpus_cache):
    """``--ddp.mode=local-sgd`` from command-line overrides on two ranks: trains, logs and checkpoints.
    (Spawning ranks through ``tessera train --nproc 2`` itself is tested once, in test_trainer.py.)"""
    args = tiny_args(tmp_path, corpus_cache, steps=4, extra=[
        "--model.n_layers=2", "--ddp.mode=local-sgd", "--ddp.average_every=2", "--run.name=cli"])
    rank_pool.run(mode_worker, 2, args=args)
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["val_loss_end"] < summary["val_loss_start"]
    assert summary["comm_total"] and (tmp_path / "cli" / "checkpoint" / "step_000004" / ".metadata").exists()
