"""A fixed ``precision.loss_scale`` in fp32 is divided out before the norm, clipping and the step, in every
path (plain DDP, a ZeRO engine, expert parallelism, a pipeline, PipeDream's in-schedule updates), and an
inf/nan on any rank skips the step on every rank.

Multiplying the loss by a power of two scales every gradient exactly, so the run with loss_scale=1024
must log the same losses and gradient norms as the run without a scale (within fp32 rounding).
"""

import json
import math

import pytest
import torch

from tessera.precision import unscale_
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config
from tessera.train.trainer import Trainer

from test_trainer import tiny_args, trainer_worker

PP = ["--parallel.pp=2", "--pipeline.microbatches=2"]
LAYOUTS = {  # name → (world size, extra args)
    "dp2": (2, []),
    "zero2-dp2": (2, ["--parallel.zero_stage=2"]),
    "zero1xpp2": (4, [*PP, "--pipeline.schedule=1f1b", "--parallel.zero_stage=1"]),
    "pp2-1f1b": (2, [*PP, "--pipeline.schedule=1f1b"]),
    "pp2-pipedream": (2, [*PP, "--pipeline.schedule=pipedream"]),
    "ep2": (2, ["--model.num_experts=4", "--moe.top_k=2", "--parallel.ep=2"]),
}
COMMON = ["--model.n_layers=4", "--checkpoint.save_final=false", "--optim.grad_clip=0.5"]


def train_lines(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["kind"] == "train"]


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fixed_loss_scale_is_divided_out(rank_pool, tmp_path, corpus_cache, name):
    world, extra = LAYOUTS[name]
    runs = {}
    for scale in ("none", "1024"):
        args = tiny_args(tmp_path, corpus_cache, extra=[*COMMON, *extra, f"--precision.loss_scale={scale}",
                                                        f"--run.name={scale}"])
        results = rank_pool.run(trainer_worker, world, args=args, timeout=600.0)
        assert all(r["skipped_steps"] == 0 for r in results)
        runs[scale] = (results[0], train_lines(tmp_path / scale))
    (plain, ref), (scaled, got) = runs["none"], runs["1024"]
    assert [r["loss_scale"] for r in got] == [1024.0] * len(ref)  # the scale was really applied
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        assert a["grad_norm"] > 0.5  # clipping acted, so a norm off by the scale would change the weights
    assert scaled["val_loss_end"] == pytest.approx(plain["val_loss_end"], rel=1e-6)


def overflow_worker(rank, world_size, args, bad_rank, bad_call):
    """The trainer with a forward hook that makes one rank's logits infinite in one training forward
    (the ``bad_call``-th) only."""
    trainer = Trainer(load_config(None, args), torch.device("cpu"))
    calls = []

    def overflow(module, inputs, out):
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == bad_call:
                return out * float("inf")
        return out

    if trainer.topology.rank == bad_rank:
        trainer.core.output.register_forward_hook(overflow)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return {"summary": summary, "params": {k: v.detach().clone() for k, v in trainer.core.state_dict().items()}}


@pytest.mark.multirank
def test_overflow_on_one_rank_skips_the_step_on_every_rank(rank_pool, tmp_path, corpus_cache):
    """tp2: the overflowing rank's infinite logits reach its tp peer only through the loss, yet both
    ranks skip step 3 (one sentence logged, counted in metrics) and train on, still in step."""
    args = tiny_args(tmp_path, corpus_cache, extra=[*COMMON, "--parallel.tp=2", "--precision.loss_scale=1024",
                                                    "--train.log_every=1", "--run.name=overflow"])
    micro_per_step = 8 // 2  # tiny_args: global batch 8, micro-batch 2, one dp rank
    results = rank_pool.run(overflow_worker, 2, args=args, bad_rank=1, bad_call=2 * micro_per_step + 1,
                            timeout=600.0)  # the first micro-batch of step 3
    assert [r["summary"]["skipped_steps"] for r in results] == [1, 1]
    train = {r["step"]: r for r in train_lines(tmp_path / "overflow")}
    assert [s for s, r in train.items() if r["skipped_at"]] == [3] and train[3]["skipped_at"] == [3]
    assert all(math.isfinite(train[s]["loss"]) for s in (4, 5, 6))
    assert results[0]["summary"]["val_loss_end"] == results[1]["summary"]["val_loss_end"]
    for name, value in results[0]["params"].items():  # replicated weights (norms) stayed identical
        other = results[1]["params"][name]
        if value.shape == other.shape and "norm" in name:
            assert torch.equal(value, other), name


def unscale_worker(rank, world_size):
    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        grads = [torch.full((3,), 8.0), torch.full((2,), float("inf") if rank == 1 else 4.0)]
        finite = unscale_(grads, 0.25, [topo.group("dp")], torch.device("cpu"))
        clean = unscale_([torch.full((3,), 8.0)], 0.25, [topo.group("dp")], torch.device("cpu"))
        return {"finite": finite, "clean": clean, "first": grads[0].tolist()}
    finally:
        topo.destroy()


@pytest.mark.multirank
def test_unscale_agrees_on_finiteness_across_ranks(rank_pool):
    results = rank_pool.run(unscale_worker, 2)
    assert [r["finite"] for r in results] == [False, False]  # rank 1's inf, seen by rank 0 too
    assert [r["clean"] for r in results] == [True, True]
    assert all(r["first"] == [2.0, 2.0, 2.0] for r in results)  # divided by the scale in place


@pytest.mark.parametrize("schedule", ["deepspeed-warmup", "cosine"])
def test_a_skipped_step_holds_deepspeed_schedules_only(tmp_path, corpus_cache, schedule):
    """DeepSpeed's engine does not step its scheduler at a step skipped for overflow: under the
    ``deepspeed-*`` schedules tessera's lr waits too; its own schedules are a function of the step."""
    args = tiny_args(tmp_path, corpus_cache, steps=6, extra=[
        "--model.n_layers=2", "--checkpoint.save_final=false", "--precision.loss_scale=1024",
        "--train.log_every=1", f"--optim.schedule={schedule}", "--optim.warmup_steps=6", f"--run.name={schedule}"])
    result = overflow_worker(0, 1, args, bad_rank=0, bad_call=2 * 4 + 1)  # step 3's first micro-batch
    assert result["summary"]["skipped_steps"] == 1
    lr = {r["step"]: r["lr"] for r in train_lines(tmp_path / schedule)}  # the lr after each step
    held = lr[3] == lr[2]
    assert held == (schedule == "deepspeed-warmup") and lr[4] != lr[3]
