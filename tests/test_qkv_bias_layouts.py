"""q/k/v biases (``model.qkv_bias``, Qwen2) on every tensor-parallel layout and every family of layout.

1. Block level: a 2D / 2.5D / 3D transformer block with random non-zero q/k/v biases, built from the dense
   block, gives the dense outputs, input gradients and every parameter gradient (biases included), with
   the bias blocks replicated (the papers' layout) and held once (the trainer's); each rank's bias is the
   block of the dense bias its ``region`` names. Which dense entries a rank holds is read off an "index"
   copy of the block whose every entry holds its own flat index (as tests/test_tp_nd.py does).
2. Trainer: a tiny qkv_bias model trains like one process (losses rel 1e-5, gradient norms rel 1e-4 at each
   of 4 steps, validation losses) under 1D tp + sequence parallelism, 2D, 2.5D, 3D, pipeline × tp, context
   parallelism × ZeRO-3, ZeRO-1, and expert parallelism × ZeRO-2 (an MoE model): the biases are zero at
   first and trained from the first update on, so later steps depend on them.
"""

from __future__ import annotations

import pytest
import torch

from tessera.comm import CommLedger
from tessera.errors import ConfigError
from tessera.models import model_config
from tessera.models.layers import TransformerBlock, precompute_rope
from tessera.models.llama import Transformer
from tessera.tensor_parallel.nd import Grid2D, Grid3D, Layout2D, Layout3D, TransformerBlockND
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config, validate_config
from tessera.train.optim import OptimConfig, param_groups

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, metrics, single_process_runs

B, S = 8, 8
CFG = model_config("tiny", dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, qkv_bias=True)
BIASED = ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias")


def _block(fill) -> TransformerBlock:
    torch.manual_seed(0)
    block = TransformerBlock(CFG)
    with torch.no_grad():
        for p in block.parameters():
            fill(p)
    return block


def dense_block() -> TransformerBlock:
    return _block(lambda p: p.normal_(0, 0.1))  # biases too: non-zero, so a misplaced block shows


def index_block() -> TransformerBlock:
    return _block(lambda p: p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p)))


def inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(B, S, CFG.dim, generator=g), torch.randn(B, S, CFG.dim, generator=g)


def block_worker(rank, world_size, mode, depth, held_once):
    topo = Topology.build(ParallelConfig(tp=world_size), CommLedger())
    tp, part = topo.group("tp"), topo.partitions["tp"]
    grid = Grid3D.build(tp, part) if mode == "3d" else Grid2D.build(tp, part, depth)
    layout = Layout3D(grid, held_once) if mode == "3d" else Layout2D(grid, held_once)
    block, idx_block = TransformerBlockND(dense_block(), layout), TransformerBlockND(index_block(), layout)
    x, r = inputs()
    x_local = layout.shard(x).requires_grad_()
    cos, sin = precompute_rope(CFG.head_dim, S)
    out = block(x_local, cos, sin)
    loss = (out * layout.shard(r)).sum()  # every output element lives on exactly one rank
    loss.backward()
    flat_idx = torch.arange(x.numel(), dtype=torch.float32).view_as(x)
    modules = dict(block.named_modules())
    regions = {n: modules[n.rsplit(".", 1)[0]].region(tuple(p.shape)) for n, p in block.named_parameters()
               if n.endswith(BIASED)}
    return {
        "loss": float(loss.detach()), "out": out.detach(), "x_grad": x_local.grad, "act_idx": layout.shard(flat_idx),
        "grads": {n: p.grad for n, p in block.named_parameters()},
        "params": {n: p.detach() for n, p in block.named_parameters()},
        "idx": {n: p.detach() for n, p in idx_block.named_parameters()},
        "regions": regions,
    }


def check_block_against_dense(outs):
    block = dense_block()
    x, r = inputs()
    x.requires_grad_()
    cos, sin = precompute_rope(CFG.head_dim, S)
    y = block(x, cos, sin)
    loss = (y * r).sum()
    loss.backward()
    y = y.detach()
    assert sum(o["loss"] for o in outs) == pytest.approx(float(loss.detach()), rel=1e-5)
    for o in outs:
        idx = o["act_idx"].long().flatten()
        torch.testing.assert_close(o["out"].flatten(), y.flatten()[idx], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["x_grad"].flatten(), x.grad.flatten()[idx], rtol=1e-5, atol=1e-5)
    dense = dict(block.named_parameters())
    for name, p in dense.items():
        seen = torch.zeros(p.numel(), dtype=torch.bool)
        for o in outs:
            idx = o["idx"][name].long().flatten()
            torch.testing.assert_close(o["grads"][name].flatten(), p.grad.flatten()[idx], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"gradient of {n}: {m}")
            seen[idx] = True
        assert seen.all(), f"{name}: some entries are held by no rank"
    for name in BIASED:
        assert dense[name].grad.abs().min() > 0  # every bias entry has a gradient to get wrong
        for o in outs:
            (full,), (start,) = o["regions"][name]
            local = o["params"][name]
            assert full == dense[name].numel()
            assert torch.equal(local, dense[name].detach()[start:start + local.numel()]), name


ND_BLOCKS = [("2d", 4, 1, False), ("2d", 4, 1, True), ("2.5d", 8, 2, True), ("3d", 8, 1, False), ("3d", 8, 1, True)]


@pytest.mark.multirank
@pytest.mark.parametrize("mode,world,depth,held_once", ND_BLOCKS,
                         ids=[f"{m}-{'held-once' if h else 'replicated'}" for m, _, _, h in ND_BLOCKS])
def test_qkv_bias_nd_block_matches_dense(rank_pool, mode, world, depth, held_once):
    check_block_against_dense(rank_pool.run(block_worker, world, mode=mode, depth=depth, held_once=held_once))


def test_biases_get_no_weight_decay_and_are_counted():
    model = Transformer(CFG, seed=0)
    decayed, plain = param_groups(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {f"layers.0.{b}" for b in BIASED} <= {names[id(p)] for p in plain["params"]}
    assert CFG.num_params() == sum(p.numel() for p in model.parameters())


def _validate(world, args):
    cfg = load_config(None, ["--model.preset=tiny", "--data.seq_len=32", "--data.global_batch_size=8",
                             "--data.micro_batch_size=1", *args])
    return validate_config(cfg, world)


def test_grid_refuses_a_bias_it_cannot_hold_once():
    """2.5D on 2×2×2: the k/v bias [n_kv_heads·head_dim = 20] has output blocks of 10, held once over 4
    ranks; without biases the same model is fine."""
    shape = ["--parallel.tp=8", "--tensor_parallel.mode=2.5d", "--tensor_parallel.depth=2", "--model.dim=40",
             "--model.n_heads=4", "--model.n_kv_heads=2"]
    _validate(8, shape)
    with pytest.raises(ConfigError) as err:
        _validate(8, [*shape, "--model.qkv_bias=true"])
    assert "n_kv_heads×head_dim (20) to be divisible by 8" in str(err.value) and "\n" not in str(err.value)


# ---- the trainer: N ranks equal one process ----------------------------------------------------------

BASE = ["--model.qkv_bias=true", "--model.n_layers=2", "--checkpoint.save_final=false", "--train.steps=4",
        "--train.log_every=1", "--train.eval_every=4", "--data.eval_batches=1"]
MOE = ["--model.num_experts=4", "--moe.top_k=2"]
LAYOUTS = {  # name → (world size, model, flags)
    "tp2-sp": (2, "dense", ["--parallel.tp=2", "--tensor_parallel.sequence_parallel=true"]),
    "2d": (4, "dense-mb4", ["--parallel.tp=4", "--tensor_parallel.mode=2d"]),
    "2.5d": (8, "dense-mb4", ["--parallel.tp=8", "--tensor_parallel.mode=2.5d", "--tensor_parallel.depth=2"]),
    "3d": (8, "dense-mb4", ["--parallel.tp=8", "--tensor_parallel.mode=3d"]),
    "pp2xtp2": (4, "dense", ["--parallel.pp=2", "--parallel.tp=2", "--pipeline.schedule=1f1b",
                             "--pipeline.microbatches=4"]),
    "cp2xzero3": (4, "dense", ["--parallel.cp=2", "--parallel.dp_shard=2", "--parallel.zero_stage=3"]),
    "zero1": (2, "dense", ["--parallel.dp_shard=2", "--parallel.zero_stage=1"]),
    "ep2xzero2": (2, "moe", ["--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.zero_stage=2"]),
}


def _args(out, cache, model, extra):
    """``model``: "dense" or "moe", "-mb4" for micro-batches of 4 (the grids: each of their micro-batches
    is hundreds of latency-bound collectives; 2 per step still accumulate) instead of 2."""
    micro = 4 if model.endswith("-mb4") else 2
    args = tiny_args(out, cache, extra=[*BASE, *(MOE if model.startswith("moe") else []), *extra])
    return [*args, "--data.global_batch_size=8", f"--data.micro_batch_size={micro}"]


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """One fp32 single-process run per model, made on first use."""
    return single_process_runs(tmp_path_factory.mktemp("reference"),
                               lambda out, model: _args(out, corpus_cache, model, [f"--run.name={model}"]))


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qkv_bias_layout_matches_single_process(rank_pool, tmp_path, corpus_cache, references, name):
    world, model, flags = LAYOUTS[name]
    single, ref = references(model)
    args = _args(tmp_path, corpus_cache, model, [*flags, f"--run.name={name}"])
    cfg = load_config(None, args)
    assert cfg.model.qkv_bias
    validate_config(cfg, world)
    results = rank_pool.run(trainer_worker, world, args=args, timeout=600.0)
    assert_like_single_process(results, single, ref, metrics(tmp_path / name), world)
