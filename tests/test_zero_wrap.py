"""ZeRO-3 units: auto-wrap by parameter count or class, manual wrap() inside enable_wrap() (seed 001's
examples), and ZeRO-3 parity with each of them and with the schedule switches turned off."""

import pytest
import torch
from torch import nn

from tessera.models.layers import TransformerBlock
from tessera.topology import ParallelConfig, Topology
from tessera.zero import FullyShardedDataParallel, class_policy, enable_wrap, manual_policy, size_policy, wrap
from tessera.zero.wrap import select_units


class Seed001(nn.Module):
    """seed 001's manual-wrapping example: layer1 and layer3 wrapped, layer2 left to the root."""

    def __init__(self):
        super().__init__()
        self.layer1 = wrap(nn.Linear(8, 4))
        self.layer2 = nn.Linear(4, 16)
        self.layer3 = wrap(nn.Linear(16, 4), reshard_after_forward=False)

    def forward(self, x):
        return self.layer3(self.layer2(self.layer1(x)))


def test_manual_wrap_marks_units_only_inside_enable_wrap():
    outside = Seed001()
    assert select_units(outside, manual_policy) == [outside]
    with enable_wrap(reshard_after_forward=True):
        model = wrap(Seed001())
    assert select_units(model, manual_policy) == [model, model.layer1, model.layer3]


def test_size_policy_wraps_children_first_and_class_policy_by_type():
    model = nn.Sequential(nn.Linear(10, 10), nn.Sequential(nn.Linear(10, 10), nn.Linear(2, 2)), nn.Linear(2, 2))
    # 110 parameters make a unit; the inner Sequential's first Linear does, then its remainder (6) does not
    assert select_units(model, size_policy(100)) == [model, model[0], model[1][0]]
    assert select_units(model, class_policy(nn.Linear)) == [model, model[0], model[1][0], model[1][1], model[2]]
    assert select_units(model, class_policy(TransformerBlock)) == [model]  # none: the root takes everything


def wrap_worker(rank, world_size, how, reshard, prefetch):
    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size))
    try:
        torch.manual_seed(0)
        if how == "manual":
            with enable_wrap(reshard_after_forward=reshard):
                model = wrap(Seed001())
            policy = manual_policy
        else:
            model = Seed001()
            policy = size_policy(40)  # layer1 (36) stays in the root, layer2 (80) and layer3 (68) are units
        opt = lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9)  # noqa: E731
        engine = FullyShardedDataParallel(model, [{"params": list(model.parameters())}], opt,
                                          topo.group("dp_shard"), topo.group("dp_replicate"), policy,
                                          torch.device("cpu"), reshard_after_forward=reshard, prefetch=prefetch)
        units = len(engine.units)
        g = torch.Generator().manual_seed(7)
        x = torch.randn(4 * world_size, 8, generator=g)
        for _ in range(3):
            local = x[rank * 4 : (rank + 1) * 4]
            (engine(local).pow(2).sum() / x.shape[0]).backward()
            engine.clip_grad_norm(0.0)
            engine.step()
            engine.zero_grad()
        return {"units": units, "params": engine.full_state()}
    finally:
        topo.destroy()


def reference():
    torch.manual_seed(0)
    model = Seed001()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(7))
    for _ in range(3):
        (model(x).pow(2).sum() / x.shape[0]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.multirank
@pytest.mark.parametrize("how,reshard,prefetch", [("manual", True, True), ("size", True, False),
                                                  ("size", False, True)])
def test_zero3_units_from_each_policy_match_single_process(rank_pool, how, reshard, prefetch):
    ref = reference()
    results = rank_pool.run(wrap_worker, 2, how=how, reshard=reshard, prefetch=prefetch)
    assert results[0]["units"] == 3
    for r in results:
        for name, value in ref.items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-6, atol=1e-6, msg=name)
