"""The expert engines at every ZeRO stage, with hybrid sharding, in mixed precision and in manual mode:
where their state lives (dense slices over dp or dp_shard, expert slices over edp; bf16 parameters with
fp32 masters), and that manual mode (a pipeline's) reduces nothing during backward and, after
``reduce_gradients()``, trains exactly like the hook-driven engines. Their parity with one process through
the trainer (ep2 × ZeRO-3, dp_replicate2 × dp_shard2 × ep2 with ZeRO-1/2/3, bf16) and their resharding
checkpoints are in tests/test_moe_zero.py.
"""

import pytest
import torch

from tessera.comm.ledger import CommLedger
from tessera.grad_norm import clip_grad_norm
from tessera.models import Transformer, model_config
from tessera.models.moe import MoEConfig
from tessera.moe import apply_expert_parallel, expert_parallelize, expert_parameters, expert_zero
from tessera.parallelize import norm_axes, sharded_axes
from tessera.precision import PrecisionConfig
from tessera.topology import ParallelConfig, Topology
from tessera.train.optim import OptimConfig, build_optimizer, optimizer_factory, param_groups
from tessera.train.step import forward_backward
from tessera.zero import ZeroConfig

CPU = torch.device("cpu")


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
        shards = engine.update.shards
        dtypes = {str(s.param.dtype) for s in shards} | {str(s.master.dtype) for s in shards}
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
