"""Expert parallelism with ZeRO-1/2: dense state sharded over dp, expert state over edp, trains like one
process, and its checkpoints reshard to and from other layouts.

The full trainer on 4 ranks (ep=2 inside dp=4, so edp=2) against one process on the same seed and global
batches: losses (rel 1e-5) and gradient norms (rel 1e-4) at every logged step, and validation losses.
"""

import pytest
import torch

from tessera.data_parallel import DDPConfig
from tessera.launch import run_rank
from tessera.models import Transformer, model_config
from tessera.models.moe import MoEConfig
from tessera.moe import ExpertZeroDataParallel, expert_parameters
from tessera.parallelize import is_sharded, parallelize
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config, validate_config
from tessera.train.optim import OptimConfig, optimizer_factory, param_groups

from test_resume import args as resume_args, records
from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, assert_tracks_fp32, metrics

MOE = ["--model.n_layers=4", "--model.num_experts=4", "--moe.top_k=2"]
COMMON = ["--checkpoint.save_final=false"]
HYBRID = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2"]  # hybrid sharding under ep
LAYOUTS = {  # name → (world size, extra args)
    "ep2xzero1": (4, ["--parallel.ep=2", "--parallel.zero_stage=1"]),
    "ep2xzero2": (4, ["--parallel.ep=2", "--parallel.zero_stage=2"]),
    "ep2xzero1-edp1": (2, ["--parallel.ep=2", "--parallel.zero_stage=1"]),  # expert state not sharded
    "ep2xtp2xzero1-sp": (4, ["--parallel.ep=2", "--parallel.tp=2", "--parallel.zero_stage=1",
                             "--tensor_parallel.sequence_parallel=true"]),  # experts whole on tp ranks
    "ep2xzero3": (2, ["--parallel.ep=2", "--parallel.zero_stage=3"]),
    "dpr2xdps2xep2xzero1": (4, [*HYBRID, "--parallel.zero_stage=1"]),
    "dpr2xdps2xep2xzero2": (4, [*HYBRID, "--parallel.zero_stage=2"]),
    "dpr2xdps2xep2xzero3": (4, [*HYBRID, "--parallel.zero_stage=3"]),  # expert units over edp=2
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache):
    out = tmp_path_factory.mktemp("reference")
    summary = run_rank(load_config(None, tiny_args(out, corpus_cache, extra=[*MOE, *COMMON, "--run.name=ref"])))
    return summary, metrics(out / "ref")


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_zero_matches_single_process(rank_pool, tmp_path, corpus_cache, reference, name):
    world, extra = LAYOUTS[name]
    single, ref = reference
    args = tiny_args(tmp_path, corpus_cache, extra=[*MOE, *COMMON, *extra, f"--run.name={name}"])
    validate_config(load_config(None, args), world)
    results = rank_pool.run(trainer_worker, world, args=args, timeout=600.0)
    assert_like_single_process(results, single, ref, metrics(tmp_path / name), world)


RESHARD = {  # name → ((world, args) that saves step 3, (world, args) that resumes from it)
    "ep2xzero1-to-dp2": ((4, ["--parallel.ep=2", "--parallel.zero_stage=1"]), (2, [])),
    "dp2-to-ep2xzero2": ((2, []), (4, ["--parallel.ep=2", "--parallel.zero_stage=2"])),
    # ZeRO-3: each unit's flat slices cut per parameter (the engines' flat_shards()), experts by global index
    "ep2xzero3-to-dp2": ((2, ["--parallel.ep=2", "--parallel.zero_stage=3"]), (2, [])),
    "dp2-to-hybrid-ep2xzero3": ((2, []), (4, [*HYBRID, "--parallel.zero_stage=3"])),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(RESHARD))
def test_expert_parallel_zero_checkpoint_resumes_on_another_layout(rank_pool, tmp_path, corpus_cache, name):
    """The step-3 checkpoint (expert slices under their global index, flat ranges cut per parameter)
    loads into the other layout, whose continued run equals the uninterrupted one."""
    (world_a, extra_a), (world_b, extra_b) = RESHARD[name]
    full = rank_pool.run(trainer_worker, world_a, args=resume_args(tmp_path, corpus_cache, "full",
                                                                   [*MOE, *extra_a]))[0]
    start = tmp_path / "full" / "checkpoint" / "step_000003"
    again = resume_args(tmp_path, corpus_cache, "next", [*MOE, *extra_b, f"--checkpoint.resume={start}"])
    resumed = rank_pool.run(trainer_worker, world_b, args=again)[0]
    assert resumed["resumed_from_step"] == 3
    assert resumed["val_loss_end"] == pytest.approx(full["val_loss_end"], rel=1e-5)
    before = {r["step"]: r for r in records(tmp_path / "full") if r["kind"] == "train"}
    after = [r for r in records(tmp_path / "next") if r["kind"] == "train"]
    assert [r["step"] for r in after] == list(range(4, 9))
    for r in after:
        assert r["loss"] == pytest.approx(before[r["step"]]["loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(before[r["step"]]["grad_norm"], rel=1e-4)


def _config(extra):
    return load_config(None, ["--model.preset=tiny", "--data.seq_len=32", "--data.global_batch_size=32",
                              "--data.micro_batch_size=2", *MOE, *extra])


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 3])
def test_expert_parallel_bf16_tracks_the_fp32_curve(rank_pool, tmp_path, corpus_cache, reference, stage):
    """bf16 weights under ep2 (stage 0: no ZeRO, the master-weight engine, dense over dp, experts over
    edp; or ZeRO-3) stay within test_precision's bound of the fp32 single-process losses, yet really differ."""
    _, ref = reference
    args = tiny_args(tmp_path, corpus_cache, extra=[*MOE, *COMMON, "--parallel.ep=2", "--precision.dtype=bf16",
                                                     f"--parallel.zero_stage={stage}", "--run.name=bf16"])
    validate_config(load_config(None, args), 2)
    rank_pool.run(trainer_worker, 2, args=args, timeout=600.0)
    assert_tracks_fp32(ref, metrics(tmp_path / "bf16"), f"bf16 ep2 ZeRO-{stage}")


@pytest.mark.parametrize("extra", [[f"--parallel.zero_stage={stage}"] for stage in (1, 2, 3)] + [
    ["--parallel.zero_stage=1", "--parallel.dp_shard=2", "--parallel.dp_replicate=2"],  # hybrid sharding
])
def test_expert_parallel_with_every_zero_stage_and_hybrid_sharding_passes_validation(extra):
    validate_config(_config(["--parallel.ep=2", *extra]), 4)


def expert_zero_engine(topo):
    """A tiny MoE model (4 experts in every block) under expert parallelism with ZeRO: (model, engine)."""
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", num_experts=4, moe_every=1), MoEConfig(top_k=2))
    cfg = OptimConfig()
    return model, parallelize(model, topo, DDPConfig(), param_groups=lambda m: param_groups(m, cfg),
                              make_optimizer=optimizer_factory(cfg))


def layout_worker(rank, world_size, ep, stage):
    """What the engine holds on this rank: master elements of dense and expert slices, and totals."""
    topo = Topology.build(ParallelConfig(dp_replicate=world_size, ep=ep, zero_stage=stage))
    try:
        model, engine = expert_zero_engine(topo)
        dense, expert = engine.parts
        experts = {id(p) for p in expert_parameters(model)}
        in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
        return {"engine": type(engine).__name__, "sharded": is_sharded(engine),
                "is_composite": isinstance(engine, ExpertZeroDataParallel),
                "dense_master": sum(s.master.numel() for s in dense.update.shards),
                "expert_master": sum(s.master.numel() for s in expert.update.shards),
                "dense_total": sum(p.numel() for p in model.parameters() if id(p) not in experts),
                "expert_total": sum(p.numel() for p in model.parameters() if id(p) in experts),
                "dense_buckets": len(dense.buckets), "expert_buckets": len(expert.buckets),
                "groups": len(engine.optimizer.param_groups),
                "optimizer_is_masters": in_optimizer == {id(s.master) for s in engine.update.shards}}
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("world, ep", [(4, 2), (2, 2)])
def test_dense_state_is_sharded_over_dp_and_expert_state_over_edp(rank_pool, world, ep):
    """ONE optimizer over every master slice; each rank keeps 1/dp of the dense and 1/edp of its experts
    (edp = world/ep; with edp = 1 the experts' state stays whole)."""
    out = rank_pool.run(layout_worker, world, ep=ep, stage=1)
    edp = world // ep
    for r in out:
        assert r["sharded"] and r["is_composite"] and r["optimizer_is_masters"] and r["groups"] == 2
        assert r["expert_total"] > 0
        # each bucket is padded to a multiple of the shard group: at most (group - 1) extra elements
        assert r["dense_total"] / world <= r["dense_master"] <= r["dense_total"] / world + r["dense_buckets"]
        assert r["expert_total"] / edp <= r["expert_master"] <= r["expert_total"] / edp + r["expert_buckets"]


def overflow_worker(rank, world_size, ep):
    """An overflow in one rank's expert gradient slice: does every rank skip the step?"""
    topo = Topology.build(ParallelConfig(dp_replicate=world_size, ep=ep, zero_stage=1))
    try:
        _, engine = expert_zero_engine(topo)
        if rank == 0:
            shard = engine.parts[1].update.shards[0]
            shard.grad = torch.zeros_like(shard.param)
            shard.grad[0] = float("inf")
        return engine.clip_grad_norm(1.0)
    finally:
        topo.destroy()


@pytest.mark.multirank
def test_an_overflow_in_one_expert_slice_makes_every_rank_skip(rank_pool):
    """Rank 0's expert slice has copies only over edp; the finiteness flag also crosses ep, so the
    ranks of the other ep group skip the step as well (else the replicas would diverge)."""
    assert rank_pool.run(overflow_worker, 4, ep=2) == [(float("inf"), False)] * 4
