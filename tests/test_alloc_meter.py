"""AllocationMeter: bytes a block allocates (peak live at once, live at exit), to the byte on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.models import Transformer
from tessera.models.config import model_config
from tessera.testing.alloc import AllocationMeter

F32 = 4  # bytes per fp32 element


def test_counts_factories_and_temporaries_to_the_byte():
    older = torch.ones(500)
    with AllocationMeter() as meter:
        a = torch.ones(1000)
        b = torch.ones(1000)
        s = (a + b).sum()  # a + b: a 4000-byte temporary, live together with a and b
        del older, a  # older was allocated before the meter: freeing it does not count
    assert meter.peak_bytes == 3 * 1000 * F32 + F32  # a, b, a+b, then the 0-d sum
    assert meter.end_bytes == 1000 * F32 + F32  # b and s
    assert meter.allocations == 4
    assert s.item() == 2000.0


def test_sees_a_temporary_made_inside_one_op():
    logits, target = torch.randn(64, 100), torch.randint(0, 100, (64,))
    with AllocationMeter() as meter:
        loss = F.cross_entropy(logits, target)  # log_softmax [64, 100] lives inside the op only
    assert 64 * 100 * F32 < meter.peak_bytes <= 64 * 100 * F32 + 64  # + nll_loss's scalars
    assert meter.end_bytes == loss.numel() * F32


def test_a_reused_block_is_counted_once_at_a_time():
    with AllocationMeter() as meter:
        for _ in range(10):
            t = torch.empty(2048)
            del t
    assert meter.peak_bytes == 2048 * F32
    assert meter.end_bytes == 0
    assert meter.allocations == 10


def test_model_build_costs_its_parameters_and_buffers():
    cfg = model_config("small", n_layers=2)
    with AllocationMeter() as meter:
        model = Transformer(cfg, seed=3)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert meter.end_bytes == held
    assert held <= meter.peak_bytes < held + 4 * (1 << 20)  # init draws at most a few chunk-sized temporaries

    with AllocationMeter() as meta:
        with torch.device("meta"):
            Transformer(cfg, seed=3)
    assert meta.peak_bytes < 1024  # only the 0-d seed scalars, nothing of the model


def test_cpu_meters_do_not_nest():
    with AllocationMeter():
        with pytest.raises(RuntimeError, match="cannot run while a profiler"):
            with AllocationMeter():
                pass
    with AllocationMeter() as again:  # the outer meter still closed cleanly
        torch.empty(10)
    assert again.peak_bytes == 10 * F32


def _meter_on_a_rank(rank, world_size):
    import torch.distributed as dist

    with AllocationMeter() as meter:
        x = torch.ones(1000 * (rank + 1))  # a different size on each rank
        y = torch.full((1000,), float(rank))
        dist.all_reduce(y)
    return meter.peak_bytes, meter.end_bytes, y[0].item()


def test_works_inside_a_rank_pool_worker(rank_pool):
    out = rank_pool.run(_meter_on_a_rank, 2)
    for rank, (peak, end, total) in enumerate(out):
        held = (1000 * (rank + 1) + 1000) * F32  # x and y
        assert total == 1.0  # 0 + 1: the all-reduce ran
        assert end == held
        assert held <= peak <= held + 1000 * F32  # gloo may stage one copy of y on the calling thread


@pytest.mark.gpu
def test_accelerator_counts_in_allocator_blocks():
    device = torch.device(torch.accelerator.current_accelerator().type, 0)
    with AllocationMeter(device) as meter:
        a = torch.ones(1000, device=device)  # 4000 bytes, one 4096-byte block of the caching allocator
        (a + a).sum()
    assert meter.end_bytes == 4096
    assert 2 * 4096 <= meter.peak_bytes <= 2 * 4096 + 512
