"""The shared gradient reducer (tessera.data_parallel.reducer) stays usable after a pass it refused."""

from __future__ import annotations

import pytest
import torch

from tessera.precision import PrecisionConfig
from tessera.topology import ParallelConfig, Topology
from tessera.zero import ZeroConfig
from tessera.zero.build import shard_model

CPU = torch.device("cpu")


def zero1_engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    topology = Topology.build(ParallelConfig(zero_stage=1))  # one process: a shard group of one
    engine = shard_model(model, [{"params": list(model.parameters())}],
                         lambda groups: torch.optim.SGD(groups, lr=0.1), topology, 1, ZeroConfig(),
                         PrecisionConfig(), CPU)
    return engine


def one_step(engine, x):
    engine(x).sum().backward()
    engine.clip_grad_norm(0.0)
    engine.step()
    engine.zero_grad()


def test_a_refused_second_reduction_leaves_the_reducer_usable():
    """ZeRO-1 reduces once per optimizer step: a second synchronised backward is refused. The refusal
    must not leave the reducer waiting for an end-of-backward callback that was never queued, or every
    later step would launch reductions it never completes."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    engine, reference = zero1_engine(), zero1_engine()
    engine(x).sum().backward()
    with pytest.raises(RuntimeError, match="once per optimizer step"):
        engine(x).sum().backward()
    engine.zero_grad()
    for p in engine.module.parameters():
        p.grad = None
    for _ in range(2):  # after the refusal, steps go on exactly like an engine that never saw one
        one_step(engine, x)
        one_step(reference, x)
    for a, b in zip(engine.module.parameters(), reference.module.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
