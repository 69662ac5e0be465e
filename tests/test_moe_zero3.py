"""Expert parallelism with ZeRO-3, with hybrid sharding, in mixed precision, and in manual mode.

The full trainer (tiny MoE: 4 layers, 4 experts, top-2) against one process on the same seed and global
batches: ep2 × ZeRO-3 (expert units gathered over edp, dense units over dp), dp_replicate2 × dp_shard2 ×
ep2 with ZeRO-1/2/3 (dense state sharded over dp_shard, replicated over dp_replicate; experts sharded over
edp), fp32: losses rel 1e-5, gradient norms rel 1e-4 at every logged step; ep2 in bf16 (fp32 master
weights, no ZeRO: stage 0) tracks the fp32 curve. Manual mode (a pipeline's): the expert engines reduce
nothing during backward and, after ``reduce_gradients()``, train exactly like the hook-driven engines.
"""

import pytest
import torch

from tessera.comm.ledger import CommLedger
from tessera.grad_norm import clip_grad_norm
from tessera.launch import run_rank
from tessera.models import Transformer, model_config
from tessera.models.moe import MoEConfig
from tessera.moe import apply_expert_parallel, expert_parallelize, expert_parameters, expert_zero
from tessera.parallelize import norm_axes, sharded_axes
from tessera.precision import PrecisionConfig
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config, validate_config
from tessera.train.optim import OptimConfig, build_optimizer, optimizer_factory, param_groups
from tessera.train.step import forward_backward
from tessera.zero import ZeroConfig

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, metrics

MOE = ["--model.n_layers=4", "--model.num_experts=4", "--moe.top_k=2"]
COMMON = ["--checkpoint.save_final=false"]
HYBRID = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2"]
LAYOUTS = {  # name → (world size, extra args)
    "ep2xzero3": (2, ["--parallel.ep=2", "--parallel.zero_stage=3"]),
    "dpr2xdps2xep2xzero1": (4, [*HYBRID, "--parallel.zero_stage=1"]),
    "dpr2xdps2xep2xzero2": (4, [*HYBRID, "--parallel.zero_stage=2"]),
    "dpr2xdps2xep2xzero3": (4, [*HYBRID, "--parallel.zero_stage=3"]),  # expert units gathered over edp=2
}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache):
    out = tmp_path_factory.mktemp("reference")
    summary = run_rank(load_config(None, tiny_args(out, corpus_cache, extra=[*MOE, *COMMON, "--run.name=ref"])))
    return summary, metrics(out / "ref")


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_zero3_and_hybrid_match_single_process(rank_pool, tmp_path, corpus_cache, reference, name):
    world, extra = LAYOUTS[name]
    single, ref = reference
    args = tiny_args(tmp_path, corpus_cache, extra=[*MOE, *COMMON, *extra, f"--run.name={name}"])
    validate_config(load_config(None, args), world)  # the layout passes validation before any rank starts
    results = rank_pool.run(trainer_worker, world, args=args, timeout=600.0)
    assert_like_single_process(results, single, ref, metrics(tmp_path / name), world)


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
    got = [r for r in metrics(tmp_path / "bf16") if r["kind"] == "train"]
    want = [r for r in ref if r["kind"] == "train"]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(want, got))
    print(f"\nbf16 ep2 ZeRO-{stage} vs fp32 one process: largest loss difference {diff:.4f} over {len(got)} logs")
    assert len(got) == len(want) and 0 < diff < 0.01


def layout_worker(rank, world_size, replicate, stage, dtype):
    """Master elements this rank holds of the dense and the expert parameters, their totals, the dtypes."""
    topo = Topology.build(ParallelConfig(dp_replicate=replicate, dp_shard=world_size // replicate, ep=2,
                                         zero_stage=stage))
    try:
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", num_experts=4, moe_every=1), MoEConfig(top_k=2))
        apply_expert_parallel(model, topo.group("ep"))
        experts = {id(p) for p in expert_parameters(model)}
        totals = [sum(p.numel() for p in model.parameters() if (id(p) in experts) == e) for e in (False, True)]
        cfg = OptimConfig()
        engine = expert_zero(model, topo, lambda m: param_groups(m, cfg), optimizer_factory(cfg), stage,
                             ZeroConfig(), norm_axes(topo), sharded_axes(model, topo),
                             precision=PrecisionConfig(dtype=dtype))
        held = [sum(s.master.numel() for s in e.update.shards) for e in engine.parts]
        groups = [(e.shard_group.axis, e.shard_group.size, e.replicate_group.size) for e in engine.parts]
        dtypes = {str(s.param.dtype) for s in engine.update.shards} | {str(s.master.dtype) for s in engine.update.shards}
        return totals, held, groups, dtypes
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("world, replicate, stage, dtype, dense_shards, expert_shards", [
    (4, 2, 1, "fp32", 2, 2),  # hybrid: dense over dp_shard=2 (replicated over dp_replicate), experts over edp=2
    (4, 2, 3, "fp32", 2, 2),
    (2, 2, 0, "bf16", 1, 1),  # master weights only: nothing sharded
])
def test_dense_and_expert_state_are_placed_as_documented(rank_pool, world, replicate, stage, dtype,
                                                         dense_shards, expert_shards):
    for totals, held, groups, dtypes in rank_pool.run(layout_worker, world, replicate=replicate, stage=stage,
                                                      dtype=dtype):
        assert [g[1] for g in groups] == [dense_shards, expert_shards]
        for total, mine, shards in zip(totals, held, (dense_shards, expert_shards)):
            assert total > 0 and total / shards <= mine <= total / shards + 16  # + padding per flat buffer
        assert dtypes == ({"torch.float32"} if dtype == "fp32" else {"torch.bfloat16", "torch.float32"})
    if stage == 0:
        assert groups[0][2] == world and groups[1][2] == world // 2  # gradients all-reduced over dp / edp


# ---- manual mode ---------------------------------------------------------------------------------

STEPS, MICRO, SEQ, BATCH = 3, 3, 16, 2


def batches(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, 256, (MICRO * BATCH, SEQ + 1), generator=g)
    return list(zip(x[:, :-1].split(BATCH), x[:, 1:].split(BATCH)))


def reductions(stats):
    return sum(s.count for (_, op), s in stats.items() if op in ("reduce_scatter", "all_reduce"))


def engine_worker(rank, world_size, stage, manual):
    """Train a tiny ep2 MoE for STEPS steps of MICRO micro-batches; ``stage`` None: DDP (ExpertDataParallel),
    else ExpertZeroDataParallel. Returns losses, norms, and the reductions issued during the backwards."""
    ledger = CommLedger()
    topo = Topology.build(ParallelConfig(dp_replicate=world_size, ep=2, zero_stage=stage or 0), ledger)
    try:
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", num_experts=4, moe_every=1), MoEConfig(top_k=2))
        cfg, dp = OptimConfig(lr=1e-2), topo.group("dp")
        if stage is None:
            engine = expert_parallelize(model, topo, manual=manual)
            optimizer = build_optimizer(model, cfg)
        else:
            apply_expert_parallel(model, topo.group("ep"))
            engine = expert_zero(model, topo, lambda m: param_groups(m, cfg), optimizer_factory(cfg), stage,
                                 ZeroConfig(), norm_axes(topo), sharded_axes(model, topo), manual=manual)
        losses, norms, in_backward = [], [], []
        for step in range(STEPS):
            mark = ledger.stats()
            losses.append(forward_backward(engine, batches(step, dp.rank), dp, CPU).loss)
            in_backward.append(reductions(ledger.since(mark)))
            if manual:
                engine.reduce_gradients()
            if stage is None:
                norms.append(clip_grad_norm(model.parameters(), norm_axes(topo), 1.0,
                                            axes_of=sharded_axes(model, topo), device=CPU))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                norms.append(engine.clip_grad_norm(1.0)[0])
                engine.step()
                engine.zero_grad()
        return losses, norms, in_backward
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [None, 1, 2, 3])
def test_manual_expert_engines_reduce_once_and_train_like_hooks(rank_pool, stage):
    hooks = rank_pool.run(engine_worker, 2, stage=stage, manual=False)
    manual = rank_pool.run(engine_worker, 2, stage=stage, manual=True)
    for (losses, norms, _), (m_losses, m_norms, m_in_backward) in zip(hooks, manual):
        assert m_losses == pytest.approx(losses, rel=1e-6)
        assert m_norms == pytest.approx(norms, rel=1e-5)
        assert m_in_backward == [2] * STEPS  # only the token count's and the loss's all-reduces
    assert all(n > 2 for n in hooks[0][2])  # the hook-driven engines do reduce during backward
