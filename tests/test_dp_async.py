"""Asynchronous data parallelism (``train/dp_modes/ps_async.py``): tested for its defined semantics.

One worker equals one process exactly; SSP's bound holds with a deliberately slow rank (the fast one
starts at most s steps ahead: the largest gap seen is exactly s); "async" never blocks the fast worker
(the slow one starts only once the fast one has finished: a bounded hand-off that fails instead of
deadlocking) and records the staleness of every push; compositions that cannot work are refused before launch.
"""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tessera.errors import ConfigError
from tessera.grad_norm import clip_grad_norm
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import JobConfig
from tessera.train.dp_modes.ps_async import AsyncParameterServer, validate_async
from tessera.train.optim import OptimConfig, optimizer_factory, param_groups

STEPS, OPTIM = 6, OptimConfig(lr=0.05, grad_clip=0.5)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


HANDOFF_S = 30.0  # how long the slow worker waits for the fast one to finish before the test fails


def wait_for_the_fast_worker(store, rank: int) -> None:
    """The slow rank's bounded hand-off: return once every other rank set its "done" key, else fail."""
    keys = [f"done{r}" for r in range(rank)]
    try:
        store.wait(keys, timedelta(seconds=HANDOFF_S))
    except RuntimeError as err:  # c10d's store timeout
        raise AssertionError(f"the fast worker did not finish its {STEPS} steps within {HANDOFF_S:g} s while the "
                             f"slow worker had not pushed anything: it was blocked on the slow worker") from err


def train_async(rank, world_size, mode, consistency, staleness=1, slow=0.0, handoff=None, dtype=torch.float32):
    """Every rank trains STEPS steps as a worker (rank world_size-1 sleeping ``slow`` s per step). With
    ``handoff`` (a FileStore path) that slow rank starts its first step only after the others finished all
    theirs (:func:`wait_for_the_fast_worker`); each other rank snapshots the server's clocks, then says so."""
    topo = Topology.build(ParallelConfig(dp_replicate=world_size, timeout_s=60))
    store = dist.FileStore(handoff, world_size) if handoff else None
    try:
        model = make_model()
        ps = AsyncParameterServer(model, topo.group("world"), mode, consistency, staleness,
                                  param_groups(model, OPTIM), optimizer_factory(OPTIM), topo.ledger, dtype=dtype)
        start = time.perf_counter()
        if store is not None and rank == world_size - 1:
            wait_for_the_fast_worker(store, rank)
        for step in range(STEPS):
            x, y = batch(step, rank)
            nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
            ps.update(OPTIM.grad_clip)
            ps.zero_grad()
            if slow and rank == world_size - 1:
                time.sleep(slow)
        seconds = time.perf_counter() - start
        clocks = list(ps.server.sync.clock) if ps.server is not None else None  # steps each worker pushed by now
        if store is not None and rank != world_size - 1:
            store.set(f"done{rank}", "1")
        ps.before_eval()
        ps.close()  # every worker's last push applied: the statistics are complete
        stats = ps.stats()
        masters = [c.dtype for c in ps.server.clones] if ps.server is not None else None
        return {"seconds": seconds, "stats": stats, "clocks": clocks, "masters": masters,
                "params": [p.detach().clone() for p in model.parameters()]}
    finally:
        topo.destroy()


def test_one_worker_async_equals_one_process():
    """The defined-semantics anchor: with one worker every push has staleness 0 and the server's update is
    the one-process update (same optimizer, groups, clipping)."""
    got = train_async(0, 1, "ps-rank0", "async")
    model = make_model()
    opt = optimizer_factory(OPTIM)(param_groups(model, OPTIM))
    for step in range(STEPS):
        x, y = batch(step, 0)
        nn.functional.mse_loss(model(x), y).backward()
        clip_grad_norm(model.parameters(), {}, OPTIM.grad_clip)
        opt.step()
        opt.zero_grad()
    for a, b in zip(got["params"], model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    assert got["stats"]["staleness_hist"] == {"0": STEPS}


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["ps-rank0", "ps-sharded"])
def test_ssp_bound_holds_with_a_slow_worker(rank_pool, mode):
    staleness = 1
    out = rank_pool.run(train_async, 2, mode=mode, consistency="ssp", staleness=staleness, slow=0.15)
    stats = out[0]["stats"]
    assert stats["ssp_max_gap"] == staleness  # the fast worker got exactly s steps ahead, never s + 1
    assert sum(stats["staleness_hist"].values()) == 2 * STEPS  # every push applied once on rank 0's server
    # blocked at s + 1 ahead: the fast rank cannot finish more than s + 1 slow steps before the slow one
    assert out[0]["seconds"] > 0.15 * (STEPS - staleness - 2)
    for a, b in zip(out[0]["params"], out[1]["params"]):  # both evaluate the servers' current parameters
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.multirank
def test_async_never_blocks_and_records_staleness(rank_pool, tmp_path):
    """The slow worker starts only once the fast one has finished all its steps: were the fast worker ever
    blocked on the slow one, the hand-off would time out and fail (never hang). The slow worker's first push
    was computed on version 0 and arrives after the fast worker's STEPS updates; every other push is fresh."""
    out = rank_pool.run(train_async, 2, mode="ps-rank0", consistency="async", handoff=str(tmp_path / "store"))
    fast = out[0]
    assert fast["clocks"] == [STEPS, 0], fast["clocks"]  # all the fast steps done, none of the slow ones
    stats = fast["stats"]
    assert stats["staleness_hist"] == {"0": 2 * STEPS - 1, str(STEPS): 1}, stats  # every push, once
    assert stats["staleness_max"] == STEPS
    assert stats["ssp_max_gap"] == STEPS  # the fast worker started its last pull STEPS steps ahead
    for a, b in zip(out[0]["params"], out[1]["params"]):  # both evaluate the server's current parameters
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.multirank
@pytest.mark.parametrize("mode, consistency", [("ps-rank0", "async"), ("ps-sharded", "ssp")])
def test_two_workers_in_bf16(rank_pool, mode, consistency):
    """bf16 at 2 ranks: the workers compute in bf16 on parameters served from fp32 masters; every push is
    applied once and both workers evaluate the servers' current parameters."""
    out = rank_pool.run(train_async, 2, mode=mode, consistency=consistency, staleness=1, dtype=torch.bfloat16)
    assert sum(out[0]["stats"]["staleness_hist"].values()) == 2 * STEPS
    assert out[0]["masters"] and set(out[0]["masters"]) == {torch.float32}
    for a, b in zip(out[0]["params"], out[1]["params"]):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("override, word", [
    ({"parallel": ParallelConfig(zero_stage=1)}, "zero_stage"),
    ({"parallel": ParallelConfig(tp=2)}, "parallel.tp"),
    ({"parallel": ParallelConfig(pp=2)}, "parallel.pp"),
    ({"parallel": ParallelConfig(dp_replicate=65)}, "at most 64 data-parallel ranks, got 65"),
])
def test_compositions_refused_with_a_reason(override, word):
    cfg = JobConfig()
    cfg.ddp.mode, cfg.ddp.consistency = "ps-sharded", "async"
    with pytest.raises(ConfigError, match=word):
        validate_async(cfg, override["parallel"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_is_accepted(dtype):
    cfg = JobConfig()
    cfg.ddp.mode, cfg.ddp.consistency = "ps-rank0", "ssp"
    cfg.precision.dtype = dtype  # fp16: a dynamic loss scale, each worker's own
    validate_async(cfg, ParallelConfig(dp_replicate=2))


def low_precision_one_worker(dtype: str, init_scale: float):
    """One worker's parameters after STEPS steps in ``dtype``, and those of one process: the ZeRO-0 engine
    (fp32 masters, compute-dtype parameters, the job's loss scaler) the trainer uses in that dtype."""
    from tessera.precision import LossScaler, PrecisionConfig
    from tessera.zero import ZeroConfig
    from tessera.zero.build import build_engine

    precision = PrecisionConfig(dtype=dtype, init_scale=init_scale)
    topo = Topology.build(ParallelConfig(timeout_s=60))
    try:
        runs = {}
        for name in ("async", "engine"):
            model, scaler = make_model(), LossScaler.from_config(precision)
            groups, make = param_groups(model, OPTIM), optimizer_factory(OPTIM)
            if name == "async":
                ps = AsyncParameterServer(model, topo.group("world"), "ps-rank0", "async", 0, groups, make,
                                          topo.ledger, dtype=precision.param_dtype)
            else:
                ps = build_engine(model, groups, make, topo.group("dp"), topo.group("dp"), 0, ZeroConfig(),
                                  precision, torch.device("cpu"))
            skipped = 0
            for step in range(STEPS):
                x, y = batch(step, 0)
                out = model(x.to(precision.param_dtype)).float()
                (nn.functional.mse_loss(out, y) * scaler.scale).backward()
                if name == "async":
                    skipped += ps.update(OPTIM.grad_clip, scaler) is None
                else:
                    _, finite = ps.clip_grad_norm(OPTIM.grad_clip, inv_scale=1.0 / scaler.scale)
                    skipped += not scaler.update(finite)
                    if finite:
                        ps.step()
                ps.zero_grad()
            if name == "async":
                ps.close()
            runs[name] = [p.detach().clone() for p in model.parameters()], skipped
        return runs
    finally:
        topo.destroy()


@pytest.mark.parametrize("dtype, init_scale", [("bf16", 1.0), ("fp16", 2.0 ** 40)])
def test_one_worker_in_low_precision_equals_one_process(dtype, init_scale):
    """The defined-semantics anchor in bf16 / fp16: the server's fp32 masters served in the compute dtype
    give exactly what one process computes with fp32 masters; fp16 starts from a loss scale that overflows,
    so the first steps are skipped (and the scale lowered) exactly as one process does."""
    runs = low_precision_one_worker(dtype, init_scale)
    (got, got_skipped), (ref, ref_skipped) = runs["async"], runs["engine"]
    assert got_skipped == ref_skipped and (got_skipped > 0) == (dtype == "fp16")
    for a, b in zip(got, ref):
        assert a.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def trainer_worker(rank, world_size, args):
    from tessera.launch import run_rank
    from tessera.train.config import load_config

    return run_rank(load_config(None, args))


@pytest.mark.multirank
def test_transformer_async_and_ssp_reach_the_synchronous_loss(rank_pool, tmp_path, corpus_cache):
    """From the command line's config: the tiny preset at 2 ranks, sync DDP vs async (ps-rank0) vs ssp
    (ps-sharded, s=1). Both asynchronous runs land within MARGIN nats of the synchronous validation loss,
    the summary records every push's staleness and SSP's gap stays within its bound."""
    margin, steps = 0.15, 16
    args = ["--model.preset=tiny", f"--train.steps={steps}", f"--train.log_every={steps}",
            f"--train.eval_every={steps}", "--data.seq_len=32", "--data.global_batch_size=8",
            "--data.micro_batch_size=4", "--data.eval_batches=2", f"--data.cache_dir={corpus_cache}",
            f"--run.out_dir={tmp_path}", "--run.progress=false", "--checkpoint.save_final=false"]
    runs = {name: rank_pool.run(trainer_worker, 2, args=[*args, f"--run.name={name}", *extra])[0]
            for name, extra in [("sync", []),
                                ("async", ["--ddp.mode=ps-rank0", "--ddp.consistency=async"]),
                                ("ssp", ["--ddp.mode=ps-sharded", "--ddp.consistency=ssp", "--ddp.staleness=1"])]}
    sync = runs["sync"]["val_loss_end"]
    assert sync < runs["sync"]["val_loss_start"] - 0.2  # the reference itself learned something
    for name in ("async", "ssp"):
        got = runs[name]
        assert got["val_loss_end"] <= sync + margin, (name, got["val_loss_end"], sync)
        assert sum(got["staleness_hist"].values()) == 2 * steps  # every push of both workers, once
    assert runs["ssp"]["ssp_max_gap"] <= 1
