"""Mixture of experts under context parallelism, ep × cp, and cp in mixed precision.

Under cp each rank holds two zig-zag chunks of every sequence; the routing group is still the whole
micro-batch (T = B·S tokens in order b·S + s), so capacity, slot filling, the auxiliary losses and the
routing counters must be what one process computes. The layer is checked against one process directly
(with a capacity that drops tokens, where routing each rank's chunks alone would differ), then the real
trainer: cp2 × MoE, dp2 × cp2 × MoE and ep2 × cp2 equal one process in fp32, and cp2 in bf16 / fp16
tracks the fp32 curve.
"""

import copy

import pytest
import torch

from tessera import comm
from tessera.context_parallel import shard_sequence
from tessera.context_parallel.moe_routing import ContextParallelRouter, group_rows
from tessera.models.moe import MoEConfig, MoEFeedForward, expert_capacity, moe_loss_sum
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config, validate_config

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, assert_tracks_fp32, metrics, single_process_runs

B, S, D, E = 2, 16, 8, 4


def test_group_rows_put_every_token_at_its_global_index():
    rows_RT = group_rows(batch=2, local_len=4, cp=2)
    # S = 8, chunks of 2: rank 0 holds positions 0,1,6,7 and rank 1 holds 2,3,4,5 of both sequences
    assert rows_RT.tolist() == [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]
    assert sorted(rows_RT.reshape(-1).tolist()) == list(range(16))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_moe_forward_is_counted_once(mode):
    """Activation checkpointing re-runs an MoE block in backward (under cp: with its all-gather); that
    forward neither counts the routing again nor leaves a routing loss behind."""
    from tessera.models import Transformer, model_config
    from tessera.models.moe import collect_local_stats
    from tessera.recompute import RecomputeConfig, apply_checkpointing, transformer_blocks

    torch.manual_seed(0)
    model = Transformer(model_config("tiny", num_experts=E, moe_every=1), MoEConfig())
    apply_checkpointing(transformer_blocks(model), RecomputeConfig(mode=mode))
    (model(torch.randint(0, 256, (B, S))).sum() + moe_loss_sum(model)).backward()
    assert collect_local_stats(model)[:, -3].tolist() == [B * S, B * S]  # tokens counted by each MoE layer
    assert moe_loss_sum(model) == 0.0


def moe_layer(top_k: int) -> MoEFeedForward:
    torch.manual_seed(0)
    return MoEFeedForward(D, 16, E, MoEConfig(top_k=top_k, capacity_factor=0.5, min_capacity=0))


def routing_worker(rank, world_size, top_k):
    """One MoE layer on the whole micro-batch (one process) against the same layer over cp ranks."""
    topo = Topology.build(ParallelConfig(cp=world_size))
    try:
        cp = topo.group("cp")
        x_BSD = torch.randn(B, S, D, generator=torch.Generator().manual_seed(7))
        whole = moe_layer(top_k)
        full = whole.router(x_BSD.reshape(-1, D), batch=B)
        (whole(x_BSD).square().sum() + moe_loss_sum(whole)).backward()
        layer = moe_layer(top_k)
        layer.router = ContextParallelRouter(layer.router, cp)
        x_BLD = shard_sequence(x_BSD, cp).requires_grad_(True)
        mine_T = group_rows(B, S // world_size, world_size)[rank]
        routing = layer.router(x_BLD.reshape(-1, D), batch=B)
        y_BLD = layer(x_BLD)
        local_alone = whole.router(x_BLD.detach().reshape(-1, D), batch=B)  # routing the chunks alone
        (y_BLD.square().sum() + moe_loss_sum(layer)).backward()
        shares = torch.stack([routing.aux_loss, routing.z_loss]).detach()
        comm.all_reduce(shares, cp)
        grad = layer.router.gate.weight.grad.clone()
        comm.all_reduce(grad, cp)
        return {
            "keep_same": torch.equal(routing.keep_TK, full.keep_TK[mine_T]),
            "alone_same": torch.equal(local_alone.keep_TK, full.keep_TK[mine_T]),
            "capacity": (routing.capacity, full.capacity, routing.tokens),
            "dropped": int((~full.keep_TK).sum()),
            "y_err": float((y_BLD - whole(x_BSD).reshape(-1, D)[mine_T].view_as(y_BLD)).abs().max()),
            "shares": shares.tolist(), "full": [float(full.aux_loss), float(full.z_loss)],
            "grad_err": float((grad - whole.router.gate.weight.grad).abs().max()),
            "grad_scale": float(whole.router.gate.weight.grad.abs().max()),
        }
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_layer_over_cp_routes_the_micro_batch_as_one_process(rank_pool, top_k):
    for r in rank_pool.run(routing_worker, 2, top_k=top_k):
        assert r["dropped"] > 0  # capacity binds, so slot order matters
        assert not r["alone_same"]  # each rank routing its chunks alone would drop other tokens
        assert r["keep_same"]  # the group's decision, this rank's rows
        want = expert_capacity(B * S, E, top_k, 0.5, 0)  # from the whole micro-batch's T, not B·S/cp
        assert r["capacity"] == (want, want, B * S)
        assert r["y_err"] < 1e-6
        assert r["shares"] == pytest.approx(r["full"], rel=1e-6)  # aux and z shares sum to the group's
        assert r["grad_err"] <= 1e-5 * r["grad_scale"]  # router gradient summed over cp = one process


def ep_cp_worker(rank, world_size):
    """dp2 × cp2 with ep2 (carved from dp: ranks of one cp index) against one process running the two
    dp ranks' micro-batches; the expert gradients summed over edp × cp (= cp here, edp being one rank)."""
    from tessera.moe import apply_expert_parallel

    topo = Topology.build(ParallelConfig(dp_replicate=2, cp=2, ep=2))
    try:
        dp, cp, ep = topo.group("dp"), topo.group("cp"), topo.group("ep")
        xs = [torch.randn(B, S, D, generator=torch.Generator().manual_seed(10 + d)) for d in range(dp.size)]
        whole = moe_layer(2)
        for x_BSD in xs:  # one process: each dp rank's micro-batch is a routing group
            (whole(x_BSD).square().sum() + moe_loss_sum(whole)).backward()
        layer = moe_layer(2)
        layer.router = ContextParallelRouter(layer.router, cp)
        inner = apply_expert_parallel(torch.nn.Sequential(layer), ep)
        x_BLD = shard_sequence(xs[dp.rank], cp)
        y_BLD = inner(x_BLD)
        (y_BLD.square().sum() + moe_loss_sum(inner)).backward()
        mine_T = group_rows(B, S // cp.size, cp.size)[cp.rank]
        with torch.no_grad():
            y_err = float((y_BLD.reshape(-1, D) - whole(xs[dp.rank]).reshape(-1, D)[mine_T]).abs().max())
        errs = []
        for i, expert in enumerate(inner[0].experts):
            want = whole.experts[inner[0].expert_offset + i]
            for p, q in zip(expert.parameters(), want.parameters()):
                comm.all_reduce(p.grad, cp)  # edp × cp: every token that reached this expert
                errs.append(float((p.grad - q.grad).abs().max() / q.grad.abs().max()))
        gate, want = inner[0].router.gate.weight.grad, whole.router.gate.weight.grad
        comm.all_reduce(gate, topo.group("dp_cp"))
        errs.append(float((gate - want).abs().max() / want.abs().max()))
        return {"y_err": y_err, "grad_rel_err": max(errs), "experts": len(inner[0].experts)}
    finally:
        topo.destroy()


@pytest.mark.multirank
def test_expert_parallel_moe_layer_over_cp_matches_one_process(rank_pool):
    """ep × cp at the layer: the all-to-all moves each rank's kept rows of the group-wide decision."""
    for r in rank_pool.run(ep_cp_worker, 4):
        assert r["experts"] == E // 2
        assert r["y_err"] < 1e-6
        assert r["grad_rel_err"] < 1e-5


MOE = ["--model.num_experts=4", "--model.moe_every=1", "--moe.top_k=2", "--moe.capacity_factor=1.0",
       "--moe.min_capacity=0"]
COMMON = ["--model.n_layers=2", "--checkpoint.save_final=false"]
LAYOUTS = {  # name → (world size, extra args)
    "cp2-moe": (2, ["--parallel.cp=2"]),
    "dp2xcp2-moe": (4, ["--parallel.cp=2"]),
    "cp2-moe-recompute": (2, ["--parallel.cp=2", "--checkpointing.mode=full"]),  # the router re-runs in backward
    "ep2xcp2": (4, ["--parallel.cp=2", "--parallel.ep=2"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """One single-process run per model (dense, moe), made on first use."""
    return single_process_runs(tmp_path_factory.mktemp("reference"), lambda out, model: tiny_args(
        out, corpus_cache, extra=[*COMMON, *(MOE if model == "moe" else []), f"--run.name={model}"]))


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_with_context_parallel_matches_single_process(rank_pool, tmp_path, corpus_cache, references, name):
    world, extra = LAYOUTS[name]
    single, ref = references("moe")
    args = tiny_args(tmp_path, corpus_cache, extra=[*COMMON, *MOE, *extra, f"--run.name={name}"])
    validate_config(load_config(None, args), world)  # the layout passes validation before any rank starts
    results = rank_pool.run(trainer_worker, world, args=args, timeout=600.0)
    got = metrics(tmp_path / name)
    assert_like_single_process(results, single, ref, got, world)
    train_ref, train_got = ([r for r in rows if r["kind"] == "train"] for rows in (ref, got))
    assert train_ref[0]["moe_dropped_frac"] > 0  # capacity binds: the slot order is tested
    for a, b in zip(train_ref, train_got):  # routing counters job-wide, as one process counts them
        assert b["moe_tokens_per_expert"] == a["moe_tokens_per_expert"]
        assert b["moe_dropped_frac"] == a["moe_dropped_frac"]
        assert b["moe_load_per_layer"] == a["moe_load_per_layer"]
        assert b["moe_aux_loss"] == pytest.approx(a["moe_aux_loss"], rel=1e-5)
        assert b["moe_z_loss"] == pytest.approx(a["moe_z_loss"], rel=1e-5)
    if "ep" in name:
        assert any(key.startswith("ep/") for key in train_got[-1]["comm_per_step"])


@pytest.mark.multirank
@pytest.mark.parametrize("dtype,method", [("bf16", "ring"), ("bf16", "ring_self_attention"), ("fp16", "ring")])
def test_context_parallel_low_precision_tracks_the_fp32_curve(rank_pool, tmp_path, corpus_cache, references,
                                                               dtype, method):
    """cp2 with bf16 (or fp16 and dynamic loss scaling) weights stays within test_precision's bound of the
    fp32 single-process losses, yet really differs (computed in low precision)."""
    single, ref = references("dense")
    args = tiny_args(tmp_path, corpus_cache, extra=[*COMMON, "--parallel.cp=2", f"--precision.dtype={dtype}",
                                                     f"--context_parallel.method={method}", f"--run.name={dtype}"])
    validate_config(load_config(None, args), 2)
    results = rank_pool.run(trainer_worker, 2, args=args, timeout=600.0)
    got = [r for r in metrics(tmp_path / dtype) if r["kind"] == "train"]
    assert_tracks_fp32(ref, got, f"{dtype} cp2 ({method})", min_logs=3)
    assert results[0]["skipped_steps"] == 0 and results[0]["val_loss_end"] < results[0]["val_loss_start"]
    assert all(m["params"] == 2 * results[0]["parameters"] for m in got[-1]["memory"])  # 2-byte weights
    assert got[-1]["loss_scale"] == (65536.0 if dtype == "fp16" else 1.0)  # fp16: dynamic loss scaling on
