"""Local SGD on gloo ranks: every=1 equals synchronous data parallelism; every=k averages k times less."""

import pytest
import torch
from torch import nn

from tessera.comm import CommGroup
from tessera.parameter_server.local_sgd import LocalSGD
from tessera.topology import ParallelConfig, Topology

PER_RANK, STEPS = 4, 6


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(PER_RANK, 8, generator=g), torch.randn(PER_RANK, 1, generator=g)


def local_sgd_worker(rank, world_size, every):
    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        group = topo.group("dp")
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        local = LocalSGD(model, group, every)
        synced, before = [], topo.ledger.stats()
        for step in range(STEPS):
            x, y = batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            synced.append(local.after_step())
        calls = sum(s.count for s in topo.ledger.since(before).values())
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "synced": synced,
                "calls": calls}
    finally:
        topo.destroy()


def synchronous_reference(world):
    """One process, gradient averaged over the ranks' batches every step (= DDP with plain SGD)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(world))) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.multirank
def test_every_step_equals_synchronous_sgd(rank_pool):
    ref = synchronous_reference(2)
    for r in rank_pool.run(local_sgd_worker, 2, every=1):
        for name, want in ref.items():
            torch.testing.assert_close(r["params"][name], want, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.multirank
def test_every_three_steps_averages_twice_and_ends_identical(rank_pool):
    results = rank_pool.run(local_sgd_worker, 2, every=3)
    assert results[0]["synced"] == [False, False, True] * 2
    assert results[0]["calls"] == STEPS // 3  # one all-reduce per average, none in between
    for name in results[0]["params"]:  # just averaged: the replicas agree ...
        torch.testing.assert_close(results[0]["params"][name], results[1]["params"][name], atol=0, rtol=0)
    ref = synchronous_reference(2)  # ... but local steps made them differ from synchronous SGD
    assert any(not torch.allclose(results[0]["params"][n], ref[n], atol=1e-6) for n in ref)


def test_local_sgd_on_one_rank_is_plain_sgd():
    local = LocalSGD(make_model(), CommGroup.single("dp"), every=2)
    assert [local.after_step() for _ in range(4)] == [False, True, False, True]
