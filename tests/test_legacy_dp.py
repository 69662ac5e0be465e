"""Single-process multi-device DataParallel and central storage over several CPU "devices"."""

import pytest
import torch
from torch import nn

from tessera.parameter_server.legacy_dp import DataParallel, central_storage


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("wrap", [lambda m: DataParallel(m, ["cpu"] * 3),
                                  lambda m: central_storage(m, ["cpu", "cpu"])])
def test_matches_one_device_forward_backward_and_steps(wrap):
    ref, mine = make_model(), wrap(make_model())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(10, 8, generator=g), torch.randint(0, 3, (10,), generator=g)  # 10 = 4 + 3 + 3
        out_ref, out_mine = ref(x), mine(x)
        torch.testing.assert_close(out_mine, out_ref, atol=1e-6, rtol=1e-6)
        nn.functional.cross_entropy(out_ref, y).backward()
        nn.functional.cross_entropy(out_mine, y).backward()
        for (n, p), q in zip(ref.named_parameters(), mine.module.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=n)
        opt_ref.step(), opt_mine.step(), opt_ref.zero_grad(), opt_mine.zero_grad()


def test_replicas_run_in_parallel_threads():
    import threading

    seen = set()
    # every replica waits here for the other three: only replicas that run at the same time get through
    # (one after another, the first would time out); a pool may otherwise reuse an idle thread
    together = threading.Barrier(4, timeout=30)

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            seen.add(threading.get_ident())
            together.wait()
            return self.lin(x)

    DataParallel(Probe(), ["cpu"] * 4)(torch.randn(8, 2))
    assert len(seen) == 4 and threading.get_ident() not in seen  # four worker threads, not the caller
