"""ZeRO's bucket and live-parameter sizes: ZeRO-1/2's all-gather buckets independent of the reduce
buckets (``zero.allgather_bucket_mb``), ZeRO-3's prefetch by parameters and live-parameter limit
(``zero.prefetch_params``, ``zero.max_live_params``), and ZeRO-1 holding only its gradient slice once
reduced. The sizes never change results; the CommLedger counts the all-gathers the plan predicts."""

import math

import pytest
import torch

from tessera.errors import ConfigError
from tessera.models.layers import TransformerBlock
from tessera.precision import PrecisionConfig
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config, validate_config
from tessera.train.step import forward_backward
from tessera.zero import ZeroConfig
from tessera.zero.build import shard_model
from tessera.zero.gather import plan_gathers
from tessera.zero.live import least_live, live_numel
from test_zero import CLIP, CPU, LR, STEPS, local_micro_batches, make_model, make_optimizer, param_groups, single_process
from tolerance import assert_close_but_few


def test_gather_plan_cuts_the_slices_into_equal_calls():
    sizes = [5, 3, 8]
    assert plan_gathers(sizes, None) == [[(0, 0, 5)], [(1, 0, 3)], [(2, 0, 8)]]
    calls = plan_gathers(sizes, 4)
    assert len(calls) == math.ceil(sum(sizes) / 4) == 4
    assert calls[1] == [(0, 4, 5), (1, 0, 3)]  # a call may span reduce buckets
    covered = sorted((i, j) for call in calls for i, a, e in call for j in range(a, e))
    assert covered == [(i, j) for i, n in enumerate(sizes) for j in range(n)]  # every element once
    assert len(plan_gathers(sizes, 100)) == 1


@pytest.mark.parametrize("key", ["allgather_bucket_mb", "prefetch_params", "max_live_params"])
def test_negative_sizes_are_refused(key):
    with pytest.raises(ConfigError, match=f"zero.{key}"):
        ZeroConfig(**{key: -1}).validate()


@pytest.mark.parametrize("overrides,message", [
    (["--parallel.zero_stage=3", "--zero.allgather_bucket_mb=4"],
     "zero.allgather_bucket_mb=4.0 has no effect in this job: it applies only to ZeRO-1/2"),
    (["--parallel.zero_stage=2", "--zero.max_live_params=100000"],
     "zero.max_live_params=100000 has no effect in this job: it applies only to ZeRO-3"),
    (["--parallel.zero_stage=1", "--zero.prefetch_params=100000"],
     "zero.prefetch_params=100000 has no effect in this job: it applies only to ZeRO-3"),
    (["--parallel.zero_stage=3", "--zero.max_live_params=-5"], "zero.max_live_params must be 0"),
])
def test_keys_outside_their_stage_are_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(None, overrides), 2)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_keys_at_their_stage_validate():
    validate_config(load_config(None, ["--parallel.zero_stage=2", "--zero.allgather_bucket_mb=4"]), 2)
    validate_config(load_config(None, ["--parallel.zero_stage=3", "--zero.prefetch_params=100000",
                                       "--zero.max_live_params=1000000"]), 2)


def train_worker(rank, world_size, stage, zero: dict):
    """``STEPS`` steps of ZeRO-``stage`` at dp=world_size; losses, full parameters, the all-gathers of the
    last step's update, the predicted count, gradient bytes held after the update, the live peak."""
    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size))
    try:
        dp = topo.group("dp")
        model = make_model()
        try:
            engine = shard_model(model, param_groups(model), make_optimizer, topo, stage, ZeroConfig(**zero),
                                 PrecisionConfig(), CPU, block_class=TransformerBlock)
        except ConfigError as err:
            return {"refused": str(err)}
        losses = []
        for step in range(STEPS):
            losses.append(forward_backward(engine, local_micro_batches(step, dp.rank, dp.size, 1), dp, CPU).loss)
            assert engine.clip_grad_norm(CLIP)[1]
            mark = topo.ledger.stats()
            engine.step()
            gathers = sum(s.count for (_, op), s in topo.ledger.since(mark).items() if op == "all_gather")
            grad_bytes = sum(g.numel() * g.element_size() for g in engine.memory_tensors()["grads"] if g is not None)
            engine.zero_grad()
        out = {"losses": losses, "gathers": gathers, "grad_bytes": grad_bytes}
        if stage < 3:
            slices = [b.shard.param.numel() for b in engine.buckets]
            cap = zero.get("allgather_bucket_mb", 0.0)
            per_rank = int(cap * 2**20) // (world_size * 4) if cap else None
            out["predicted"] = math.ceil(sum(slices) / per_rank) if per_rank else len(slices)
            out["slice_bytes"] = 4 * sum(slices)
            params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            out.update(peak=engine.live.peak, least=least_live(engine.units))
            params = engine.full_state()
            out["tally"] = (engine.live.tally.numel, live_numel(engine.units))  # running count, recount
        out["params"] = params
        return out
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 2])
def test_allgather_buckets_change_the_calls_not_the_results(rank_pool, stage):
    """Tiny reduce buckets (0.01 MB: many), all-gathers per reduce bucket, in 2 KiB buckets (many more,
    spanning reduce buckets) and in one 64 MB bucket (one call): identical parameters, predicted counts."""
    runs = {ag: rank_pool.run(train_worker, 2, stage=stage, zero={"bucket_mb": 0.01, "allgather_bucket_mb": ag})
            for ag in (0.0, 2 / 1024, 64.0)}
    base = runs[0.0][0]
    assert base["gathers"] == base["predicted"] >= 5
    assert runs[2 / 1024][0]["gathers"] == runs[2 / 1024][0]["predicted"] > base["gathers"]
    assert runs[64.0][0]["gathers"] == 1
    for ag, results in runs.items():
        for r in results:
            assert r["gathers"] == r["predicted"], ag
            assert r["losses"] == base["losses"]
            for name, value in base["params"].items():
                assert torch.equal(r["params"][name], value), (ag, name)
            # once reduced, ZeRO-1 (as ZeRO-2) holds only this rank's fp32 gradient slices
            assert r["grad_bytes"] == r["slice_bytes"]


def check_zero3(rank_pool, zero: dict) -> list[dict]:
    ref_losses, _, ref_params = single_process(2)
    results = rank_pool.run(train_worker, 2, stage=3, zero=zero)
    for r in results:
        torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-6, atol=1e-6)
        for name, value in ref_params.items():
            assert_close_but_few(r["params"][name], value, rtol=1e-5, atol=2e-5, loose_atol=2 * LR * STEPS, msg=name)
    return results


@pytest.mark.multirank
def test_zero3_prefetch_params_and_max_live_params_match_single_process(rank_pool):
    free = rank_pool.run(train_worker, 2, stage=3, zero={"prefetch": 3, "max_live_params": 10**9})[0]
    least = free["least"]  # the root and the largest unit
    limit = least + 4096  # room for part of one more unit: prefetch must stop early
    assert free["peak"] > limit  # unlimited, prefetching 3 units holds more than the limit
    for r in check_zero3(rank_pool, {"prefetch": 3, "max_live_params": limit}):
        assert least <= r["peak"] <= limit
        assert r["tally"][0] == r["tally"][1]  # the running live count agrees with summing every flat
    check_zero3(rank_pool, {"prefetch_params": 10_000})  # two units ahead (each under 10,000)
    check_zero3(rank_pool, {"prefetch_params": 10_000, "max_live_params": least, "reshard_after_forward": False})
    refused = rank_pool.run(train_worker, 2, stage=3, zero={"max_live_params": least - 1})[0]
    assert f"zero.max_live_params={least - 1} is smaller than the {least} parameters" in refused["refused"]
