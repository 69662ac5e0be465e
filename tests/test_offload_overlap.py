"""Host offload with its copies overlapped with compute (tessera.zero.offload.overlap): the same training as
offload without overlap, at dp2 ZeRO-2 and ZeRO-3, on the CPU (where the device is the host) and on the
emulated accelerator with a copier that holds every copy until it is waited for, so a read of a host
gradient or a device parameter before its wait would see the NaNs a copy in flight leaves there."""

import contextlib

import pytest
import torch

from tessera.models.layers import TransformerBlock
from tessera.testing.emulated_accelerator import EmulatedAccelerator
from tessera.topology import ParallelConfig, Topology
from tessera.train.step import forward_backward
from tessera.zero import FullyShardedDataParallel, ZeroDataParallel, class_policy
from tessera.zero.offload.overlap import HostCopies, InlineCopier, StreamCopier, overlap_host_copies

from test_zero import CLIP, local_micro_batches, make_model, make_optimizer, param_groups

ACCEL, HOST = torch.device("cpu", 0), torch.device("cpu")
STEPS, ACCUM = 2, 2  # two micro-batches: a shard's second reduction lands the first one's copy


class DeferredCopier(InlineCopier):
    """A copy stream that has not run yet: every copy waits in a queue and is made, in order, only when it
    (or a later one) is waited for; until then its destination holds NaNs."""

    def __init__(self):
        self.queue: list[tuple[object, torch.Tensor, torch.Tensor]] = []
        self.waits = {"host": 0, "device": 0}

    def copy(self, dst, src):
        token = object()
        dst.fill_(float("nan"))
        self.queue.append((token, dst, src))
        return token

    def _run_to(self, token) -> None:
        while any(t is token for t, _, _ in self.queue):
            _, dst, src = self.queue.pop(0)
            dst.copy_(src)

    def wait_host(self, ready) -> None:
        self.waits["host"] += 1
        self._run_to(ready)

    def wait_device(self, ready) -> None:
        self.waits["device"] += 1
        self._run_to(ready)


def build(model, topo, stage, device):
    shard, replicate = topo.group("dp_shard"), topo.group("dp_replicate")
    if stage == 3:
        return FullyShardedDataParallel(model, param_groups(model), make_optimizer, shard, replicate,
                                        class_policy(TransformerBlock), device, offload_device=HOST)
    return ZeroDataParallel(model, param_groups(model), make_optimizer, shard, replicate, stage, bucket_mb=0.01,
                            offload_device=HOST)


def offload_worker(rank, world_size, stage, how):
    """``how``: "plain" (offload without overlap), "overlap" (on the CPU) or "deferred" (the emulated
    accelerator, copies held until waited for)."""
    emulate = how == "deferred"
    device = ACCEL if emulate else HOST
    with EmulatedAccelerator(ACCEL) if emulate else contextlib.nullcontext():
        topo = Topology.build(ParallelConfig(dp_shard=world_size), device=device)
        try:
            model = make_model().to(device)
            engine = build(model, topo, stage, device)
            copier = DeferredCopier() if emulate else None
            if how != "plain":
                overlap_host_copies(engine, device, copier)
                assert all(s.copies is not None for s in engine.update.shards)
            losses, norms = [], []
            dp = topo.group("dp")
            for step in range(STEPS):
                batches = local_micro_batches(step, dp.rank, dp.size, ACCUM)
                losses.append(forward_backward(engine, batches, dp, device).loss)
                norm, finite = engine.clip_grad_norm(CLIP)
                assert finite
                norms.append(norm)
                engine.step()
                engine.zero_grad()
            params = [s.master.detach().to(HOST).clone() for s in engine.update.shards]
            grads_on_host = all(s.grad is None or s.grad.device == HOST for s in engine.update.shards)
            return {"losses": losses, "norms": norms, "masters": params, "waits": copier and copier.waits,
                    "left": len(copier.queue) if copier else 0, "grads_on_host": grads_on_host}
        finally:
            topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_with_overlap_matches_offload_without(rank_pool, stage):
    plain = rank_pool.run(offload_worker, 2, stage=stage, how="plain")
    for how in ("overlap", "deferred"):
        got = rank_pool.run(offload_worker, 2, stage=stage, how=how)
        for a, b in zip(plain, got):
            torch.testing.assert_close(b["losses"], a["losses"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(b["norms"], a["norms"], rtol=1e-6, atol=1e-7)
            for x, y in zip(a["masters"], b["masters"]):
                torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7)
                assert torch.isfinite(y).all()
        if how == "deferred":
            for r in got:
                # every reduced slice went through the copier and was waited for by the host; ZeRO-3's
                # parameter shards went up through it too, each waited for by the device before its gather
                assert r["waits"]["host"] >= STEPS * ACCUM and r["left"] == 0 and r["grads_on_host"]
                assert (r["waits"]["device"] > 0) == (stage == 3)


def test_host_copies_add_in_the_order_the_slices_arrive_and_only_when_landed():
    """One shard, two reduced slices: nothing reaches ``shard.grad`` before the host waits for it."""
    from tessera.zero.shards import Shard

    copier = DeferredCopier()
    copies = HostCopies(ACCEL, copier)
    with EmulatedAccelerator(ACCEL):
        shard = Shard(0, torch.zeros(4, device=ACCEL), torch.nn.Parameter(torch.zeros(4)))
        copies.add_grad(shard, torch.full((4,), 1.0, device=ACCEL))
        assert shard.grad is None and copier.waits["host"] == 0  # in flight: nothing read yet
        copies.add_grad(shard, torch.full((4,), 2.0, device=ACCEL))  # lands the first one
        assert torch.equal(shard.grad, torch.ones(4)) and copier.waits["host"] == 1
        copies.land()
        assert torch.equal(shard.grad, torch.full((4,), 3.0)) and not copies.pending


@pytest.mark.gpu
def test_stream_copies_on_an_accelerator_land_what_the_device_computed():
    from tessera.device import resolve_device
    from tessera.zero.shards import Shard

    device = resolve_device("cuda")
    copies = HostCopies(device, StreamCopier(device))
    shard = Shard(0, torch.zeros(1 << 20).pin_memory(), torch.nn.Parameter(torch.zeros(1 << 20).pin_memory()))
    for k in range(1, 4):
        copies.add_grad(shard, torch.full((1 << 20,), float(k), device=device) * 2)  # computed, then copied
    copies.land()
    assert torch.equal(shard.grad, torch.full((1 << 20,), 12.0))
    up = copies.to_device(shard.grad)
    assert up.device == device and float(up.sum()) == 12.0 * (1 << 20)
