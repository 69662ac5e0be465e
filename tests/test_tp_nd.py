"""Colossal-AI 2D (SUMMA), 2.5D and 3D tensor parallelism: a transformer block against the dense one.

Each rank holds blocks of activations and weights; to compare them with the dense model without writing
the block layout twice, the layers are also built from an "index" copy of the dense block whose every
entry holds its own flat index: the sharded index tensors then say which dense entries a rank holds.
"""

import pytest
import torch

from tessera.comm import CommLedger
from tessera.models import model_config
from tessera.models.layers import TransformerBlock, precompute_rope
from tessera.tensor_parallel import volumes
from tessera.tensor_parallel.nd import Grid2D, Grid3D, Layout2D, Layout3D, TransformerBlockND
from tessera.topology import ParallelConfig, Topology

B, S = 8, 8
CFG = model_config("tiny", dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64)


def dense_block() -> TransformerBlock:
    torch.manual_seed(0)
    block = TransformerBlock(CFG)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    return block


def index_block() -> TransformerBlock:
    block = TransformerBlock(CFG)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p))
    return block


def inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(B, S, CFG.dim, generator=g), torch.randn(B, S, CFG.dim, generator=g)


def rope():
    return precompute_rope(CFG.head_dim, S)


def nd_worker(rank, world_size, mode, depth):
    ledger = CommLedger()
    topo = Topology.build(ParallelConfig(tp=world_size), ledger)
    tp, part = topo.group("tp"), topo.partitions["tp"]
    grid = Grid3D.build(tp, part) if mode == "3d" else Grid2D.build(tp, part, depth)
    layout = Layout3D(grid) if mode == "3d" else Layout2D(grid)
    block, idx_block = TransformerBlockND(dense_block(), layout), TransformerBlockND(index_block(), layout)
    x, r = inputs()
    x_local = layout.shard(x).requires_grad_()
    cos, sin = rope()
    before = ledger.stats()
    out = block(x_local, cos, sin)
    fwd = ledger.since(before)
    loss = (out * layout.shard(r)).sum()  # every output element lives on exactly one rank
    before = ledger.stats()
    loss.backward()
    bwd = ledger.since(before)
    flat_idx = torch.arange(x.numel(), dtype=torch.float32).view_as(x)
    return {
        "loss": float(loss.detach()),
        "out": out.detach(), "x_grad": x_local.grad, "act_idx": layout.shard(flat_idx),
        "grads": {n: p.grad for n, p in block.named_parameters()},
        "idx": {n: p.detach() for n, p in idx_block.named_parameters()},
        "fwd": by_op(fwd), "bwd": by_op(bwd),
    }


def by_op(stats) -> dict:
    """Payload bytes per op, summed over the grid's axes."""
    out = {}
    for (_, op), stat in stats.items():
        out[op] = out.get(op, 0) + stat.bytes
    return out


def check_against_dense(outs, q, depth, mode):
    block = dense_block()
    x, r = inputs()
    x.requires_grad_()
    cos, sin = rope()
    y = block(x, cos, sin)
    loss = (y * r).sum()
    loss.backward()
    assert sum(o["loss"] for o in outs) == pytest.approx(float(loss), rel=1e-5)
    covered = torch.zeros(x.numel(), dtype=torch.bool)
    for o in outs:
        idx = o["act_idx"].long().flatten()
        torch.testing.assert_close(o["out"].flatten(), y.detach().flatten()[idx], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["x_grad"].flatten(), x.grad.flatten()[idx], rtol=1e-5, atol=1e-5)
        covered[idx] = True
    assert covered.all()
    for name, p in block.named_parameters():
        seen = torch.zeros(p.numel(), dtype=torch.bool)
        for o in outs:
            idx = o["idx"][name].long().flatten()
            torch.testing.assert_close(o["grads"][name].flatten(), p.grad.flatten()[idx], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"gradient of {n}: {m}")
            seen[idx] = True
        assert seen.all(), f"{name}: some entries are held by no rank"
    # CommLedger against the algorithms' formulas (all tp sub-axes together).
    kv = CFG.n_kv_heads * CFG.head_dim
    want_fwd, want_bwd = volumes.nd_block(mode, B, S, CFG.dim, kv, CFG.ffn_hidden_dim, q, depth)
    for o in outs:
        assert o["fwd"] == want_fwd
        assert o["bwd"] == want_bwd


@pytest.mark.parametrize("mode,world,q,depth", [("2d", 4, 2, 1)], ids=["2d"])
def test_tp2d_matches_single_process(rank_pool, mode, world, q, depth):
    check_against_dense(rank_pool.run(nd_worker, world, mode=mode, depth=depth), q, depth, mode)


def test_tp2p5d_matches_single_process(rank_pool):
    check_against_dense(rank_pool.run(nd_worker, 8, mode="2.5d", depth=2), 2, 2, "2.5d")


def test_tp3d_matches_single_process(rank_pool):
    check_against_dense(rank_pool.run(nd_worker, 8, mode="3d", depth=1), 2, 1, "3d")
