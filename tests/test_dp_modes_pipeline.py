"""Data-parallel modes under a pipeline (``ddp.mode`` with ``parallel.pp`` > 1, built per stage).

Each stage's replicas are its dp ranks: the synchronous parameter servers (rank 0 of each stage's dp group,
or sharded over it) equal one process at pp2 × dp2 (losses, gradient norms, every stage's final parameters
under the full model's names); local SGD averaging after every plain SGD step equals one process, and
averaging every 2 steps leaves the replicas of a stage different after step 1 and exactly equal after step 2.
In bf16 each mode keeps fp32 masters per stage (the rank-0 server's, the sharded engine's, a ZeRO-0 engine
per local-SGD replica) and tracks fp32 one process.
"""

from __future__ import annotations

import json

import pytest
import torch

from tessera.train.config import load_config
from tessera.train.trainer import Trainer

from test_trainer import tiny_args
from test_trainer_strategies import LOW_PRECISION_BOUND

PIPE = ["--model.n_layers=2", "--checkpoint.save_final=false", "--train.log_every=1",
        "--pipeline.microbatches=2"]
SGD = ["--optim.name=sgd", "--optim.grad_clip=0"]
STEPS = 2


def metrics(run_dir):
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def named_worker(rank, world_size, args):
    """Train step by step: this rank's parameters (full-model names, in fp32) after every step, and their dtypes."""
    trainer = Trainer(load_config(None, args), torch.device("cpu"))
    after, dp_rank = [], trainer.topology.group("dp").rank
    try:
        for step in range(1, STEPS + 1):
            trainer.step_once(step)
            after.append({n: p.detach().float().clone() for n, p in trainer.core.named_parameters()})
    finally:
        trainer.close()
    return {"dp": dp_rank, "after": after, "dtypes": {p.dtype for p in trainer.core.parameters()}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache):
    """``get(*extra) -> (metrics, parameters after each step)`` of one process, made once per variant."""
    out, done = tmp_path_factory.mktemp("dp_modes_pp_ref"), {}

    def get(*extra):
        if extra not in done:
            name = f"ref{len(done)}"
            result = named_worker(0, 1, tiny_args(out, corpus_cache, steps=STEPS, extra=[*PIPE, *extra,
                                                                                     f"--run.name={name}"]))
            done[extra] = metrics(out / name), result["after"]
        return done[extra]

    return get


def assert_matches(ref, run_dir, results, norms=True):
    """Same losses (and gradient norms: local SGD reports its replica's own) and parameters as one process."""
    ref_metrics, ref_after = ref
    mine = metrics(run_dir)
    assert len(mine) == len(ref_metrics) == STEPS
    for (a, na), (b, nb) in zip(ref_metrics, mine):
        assert b == pytest.approx(a, rel=1e-5) and (not norms or nb == pytest.approx(na, rel=1e-4))
    for result in results:  # every rank's stage parameters, after every step
        for step, params in enumerate(result["after"]):
            assert params  # a stage holds something
            for name, p in params.items():
                torch.testing.assert_close(p, ref_after[step][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["ps-rank0", "ps-sharded"])
def test_parameter_server_per_stage_matches_single_process(rank_pool, tmp_path, corpus_cache, reference, mode):
    args = tiny_args(tmp_path, corpus_cache, steps=STEPS, extra=[*PIPE, f"--ddp.mode={mode}", "--parallel.pp=2",
                                                                "--run.name=ps"])
    results = rank_pool.run(named_worker, 4, args=args)
    assert_matches(reference(), tmp_path / "ps", results)


@pytest.mark.multirank
def test_local_sgd_per_stage_every_step_with_sgd_matches_single_process(rank_pool, tmp_path, corpus_cache,
                                                                        reference):
    args = tiny_args(tmp_path, corpus_cache, steps=STEPS, extra=[*PIPE, *SGD, "--ddp.mode=local-sgd",
                                                                "--ddp.average_every=1", "--parallel.pp=2",
                                                                "--run.name=ls"])
    results = rank_pool.run(named_worker, 4, args=args)
    assert_matches(reference(*SGD), tmp_path / "ls", results, norms=False)


@pytest.mark.multirank
def test_local_sgd_per_stage_replicas_agree_exactly_at_the_average(rank_pool, tmp_path, corpus_cache):
    """Ranks (pp, dp): the two dp replicas of each stage differ after step 1 and are equal after step 2."""
    args = tiny_args(tmp_path, corpus_cache, steps=STEPS, extra=[*PIPE, "--ddp.mode=local-sgd",
                                                                "--ddp.average_every=2", "--parallel.pp=2",
                                                                "--run.name=k2"])
    results = rank_pool.run(named_worker, 4, args=args)
    stages = {}
    for r in results:  # the replicas of a stage hold the same names
        stages.setdefault(tuple(sorted(r["after"][0])), []).append(r)
    assert len(stages) == 2 and all(len(pair) == 2 and {r["dp"] for r in pair} == {0, 1} for pair in stages.values())
    for a, b in stages.values():
        assert any(not torch.equal(a["after"][0][n], b["after"][0][n]) for n in a["after"][0])  # own batches
        for n in a["after"][1]:  # one all-reduce of this stage's parameters made them equal
            assert torch.equal(a["after"][1][n], b["after"][1][n]), n


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["ps-rank0", "ps-sharded", "local-sgd"])
def test_modes_per_stage_in_bf16_track_fp32(rank_pool, tmp_path, corpus_cache, reference, mode):
    sgd = [*SGD, "--ddp.average_every=1"] if mode == "local-sgd" else []
    ref = reference(*SGD)[0] if sgd else reference()[0]
    args = tiny_args(tmp_path, corpus_cache, steps=STEPS, extra=[*PIPE, *sgd, "--precision.dtype=bf16",
                                                                f"--ddp.mode={mode}", "--parallel.pp=2",
                                                                "--run.name=low"])
    results = rank_pool.run(named_worker, 4, args=args)
    diff = max(abs(a - b) for (a, _), (b, _) in zip(ref, metrics(tmp_path / "low")))
    assert len(metrics(tmp_path / "low")) == STEPS and 0 < diff < LOW_PRECISION_BOUND, diff
    for r in results:  # the stage parameters are in the compute dtype (rounded from the fp32 masters)
        assert r["dtypes"] == {torch.bfloat16}
