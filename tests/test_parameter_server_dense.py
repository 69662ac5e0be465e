"""Dense variants on gloo ranks: parameter server on rank 0, sharded parameter server, ring all-reduce.

Each equals one-process training; the CommLedger shows where the bytes go (rank 0 is the bottleneck of
a rank-0 server, the sharded server moves what a ring all-reduce moves).
"""

import pytest
import torch
from torch import nn

from tessera.comm import CommGroup
from tessera.parameter_server.dense import DENSE_STRATEGIES, DenseParameterSync
from tessera.topology import ParallelConfig, Topology

GLOBAL_BATCH, STEPS = 8, 3


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 4))  # 697 params: not a multiple of 2


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def make_opt(optimizer):
    if optimizer == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1)
    return lambda ps: torch.optim.Adam(ps, lr=0.01)


def train(group: CommGroup, strategy: str, optimizer: str):
    model = make_model()
    sync = DenseParameterSync(model, group, strategy, make_opt(optimizer))
    per = GLOBAL_BATCH // group.size
    stats = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[group.rank * per:(group.rank + 1) * per], y[group.rank * per:(group.rank + 1) * per]
        (nn.functional.mse_loss(model(x), y, reduction="sum") / GLOBAL_BATCH).backward()
        before = group.ledger.stats()
        sync.step()
        stats.append(sum(s.wire_bytes for s in group.ledger.since(before).values()))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, stats


def dense_worker(rank, world_size, strategy, optimizer):
    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        params, wire = train(topo.group("dp"), strategy, optimizer)
        return {"params": params, "wire": wire}
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_dense_variants_equal_one_process_and_bytes_follow_the_formulas(rank_pool, optimizer):
    world = 2
    ref, _ = train(CommGroup.single("dp"), "allreduce", optimizer)
    n_bytes = sum(p.numel() for p in ref.values()) * 4
    busiest = {}
    for strategy in DENSE_STRATEGIES:
        results = rank_pool.run(dense_worker, world, strategy=strategy, optimizer=optimizer)
        for r in results:
            for name, want in ref.items():
                torch.testing.assert_close(r["params"][name], want, atol=1e-6, rtol=1e-5, msg=f"{strategy} {name}")
        busiest[strategy] = max(r["wire"][0] for r in results)
    padded = -(-n_bytes // (4 * world)) * 4 * world
    assert busiest["ps_rank0"] == pytest.approx(2 * (world - 1) * n_bytes)  # gather + scatter at rank 0
    assert busiest["allreduce"] == pytest.approx(2 * (world - 1) / world * n_bytes)
    assert busiest["ps_sharded"] == pytest.approx(2 * (world - 1) / world * padded)
