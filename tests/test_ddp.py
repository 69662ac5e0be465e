"""Distributed data parallel: N gloo ranks against one process on the same global batch."""

import contextlib

import pytest
import torch
from torch import nn

from tessera.comm import CommGroup
from tessera.data_parallel import DistributedDataParallel
from tessera.data_parallel.buckets import build_buckets, in_arrival_order
from tessera.models import Transformer, model_config
from tessera.topology import ParallelConfig, Topology
from tessera.train.step import forward_backward
from tolerance import ADAM_EPS

GLOBAL_BATCH, SEQ, STEPS = 8, 16, 4


class WithUnused(nn.Module):
    """The tiny transformer plus a layer the forward never calls (its gradient never arrives)."""

    def __init__(self):
        super().__init__()
        self.core = Transformer(model_config("tiny"))
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.core(x)


def make_model(unused: bool) -> nn.Module:
    torch.manual_seed(0)
    return WithUnused() if unused else Transformer(model_config("tiny"))


def global_batches(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def local_micro_batches(step: int, rank: int, world: int, accum: int):
    """This rank's contiguous slice of the global batch, cut into ``accum`` micro-batches."""
    x, y = global_batches(step)
    per_rank = GLOBAL_BATCH // world
    x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
    return list(zip(x.chunk(accum), y.chunk(accum)))


def train(model, dp: CommGroup, rank: int, world: int, accum: int, steps: int = STEPS):
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2, weight_decay=0.1, eps=ADAM_EPS)
    losses = []
    for step in range(steps):
        batches = local_micro_batches(step, rank, world, accum)
        losses.append(forward_backward(model, batches, dp, torch.device("cpu")).loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return losses, {k: v.detach().clone() for k, v in inner.state_dict().items()}


def ddp_worker(rank, world_size, accum, unused, find_unused, bucket_mb):
    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        dp = topo.group("dp")
        model = DistributedDataParallel(make_model(unused), dp, bucket_mb=bucket_mb,
                                        find_unused_parameters=find_unused, reduce_op="sum")
        losses, params = train(model, dp, rank, world_size, accum)
        grads_none = None
        if unused:  # one more backward, to look at the gradient before an optimizer clears it
            forward_backward(model, local_micro_batches(0, rank, world_size, accum), dp, torch.device("cpu"))
            grads_none = model.module.unused.weight.grad is None
        return {"losses": losses, "params": params, "n_buckets": len(model.buckets), "unused_none": grads_none}
    finally:
        topo.destroy()


def single_process(accum: int, unused: bool):
    return train(make_model(unused), CommGroup.single("dp"), 0, 1, accum)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_matches_single_process(rank_pool, world, accum):
    ref_losses, ref_params = single_process(accum * world, unused=False)  # same micro-batch size
    results = rank_pool.run(ddp_worker, world, accum=accum, unused=False, find_unused=False, bucket_mb=0.02)
    assert results[0]["n_buckets"] > 1  # several buckets, so launch order matters
    # Two ranks, no accumulation: the single process sums the same two micro-batch gradients, a + b,
    # that the all-reduce sums, so nothing may differ at all. Otherwise only the association of the
    # sum changes: ~1e-7 relative in the gradient, which AdamW (update ~lr=1e-2) turns into ≤ ~1e-5.
    exact = world == 2 and accum == 1
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=2e-5)
    for r in results:
        torch.testing.assert_close(r["losses"], ref_losses, **(tol if exact else dict(rtol=1e-6, atol=1e-6)))
        for name, value in ref_params.items():
            torch.testing.assert_close(r["params"][name], value, **tol, msg=name)
    # the replicas stay bit-identical to each other: every rank applied the same reduced gradient
    for name in ref_params:
        assert all(torch.equal(r["params"][name], results[0]["params"][name]) for r in results)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("find_unused", [True, False])
def test_ddp_with_unused_parameter_matches_single_process(rank_pool, world, find_unused):
    ref_losses, ref_params = single_process(world, unused=True)
    results = rank_pool.run(ddp_worker, world, accum=1, unused=True, find_unused=find_unused, bucket_mb=25.0)
    for r in results:
        torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-6, atol=1e-6)
        for name, value in ref_params.items():
            if name.startswith("unused") and not find_unused:
                # without the extra all-reduce it gets zero gradients: Adam's update is 0/(0+eps)
                # and only the decoupled weight decay moves it, by (1 - lr·wd) per step
                value = value * (1 - 1e-2 * 0.1) ** STEPS
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=2e-5, msg=name)
        assert r["unused_none"] is find_unused


def test_buckets_fill_in_reverse_order_within_cap():
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 400, 10)]
    buckets = build_buckets(list(reversed(params)), cap_bytes=1600)  # 400 floats
    assert [[p.numel() for p in b.params] for b in buckets] == [[10], [400], [50, 300], [100]]
    assert all(b.size == sum(p.numel() for p in b.params) and b.buffer is None for b in buckets)
    assert [b.offsets for b in buckets] == [[0], [0], [0, 50], [0]]
    mixed = build_buckets([nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, dtype=torch.float64))], 1 << 20)
    assert [b.allocate().dtype for b in mixed] == [torch.float32, torch.float64]


def test_ddp_buckets_fill_to_the_cap_as_torch_lays_them():
    """``fill_to_cap`` (DDP): a bucket closes once it holds the cap, so its last parameter may pass it; the
    same parameters make fewer buckets than under the ceiling rule, and torch's DDP makes the same ones."""
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 400, 10)]
    filled = build_buckets(list(reversed(params)), cap_bytes=1600, fill_to_cap=True)  # 400 floats
    assert [[p.numel() for p in b.params] for b in filled] == [[10, 400], [50, 300, 100]]
    assert [b.size for b in filled] == [410, 450]
    from torch.distributed import _compute_bucket_assignment_by_size as torch_rule

    order = list(reversed(params))
    torch_buckets = torch_rule([p.detach() for p in order], [1600])[0]
    position = {id(p): i for i, p in enumerate(order)}
    assert [[position[id(p)] for p in b.params] for b in filled] == torch_buckets


def test_buckets_split_by_param_group_and_pad_for_sharding():
    """The same builder serves ZeRO: a new bucket when the optimizer group changes, each padded to a
    multiple of the shard count (at least one element per rank)."""
    a, b, c, d = (nn.Parameter(torch.zeros(n)) for n in (5, 6, 7, 1))
    group = {id(a): 0, id(b): 0, id(c): 1, id(d): 0}
    buckets = build_buckets([a, b, c, d], 1 << 20, lambda p: group[id(p)], pad_to=4)
    assert [[p.numel() for p in x.params] for x in buckets] == [[5, 6], [7], [1]]
    assert [x.param_group for x in buckets] == [0, 1, 0]
    assert [x.size for x in buckets] == [12, 8, 4]
    assert float(buckets[0].allocate()[11]) == 0.0 and buckets[0].allocate().numel() == 12


def test_buckets_launch_in_the_order_backward_fills_them():
    """ZeRO's buckets follow its param groups; their launch order follows the gradients' arrival."""
    w1, b1, w2, b2 = (nn.Parameter(torch.zeros(n)) for n in (8, 2, 8, 2))  # registration order
    group = {id(w1): 0, id(w2): 0, id(b1): 1, id(b2): 1}
    buckets = build_buckets([w2, w1, b2, b1], 40, lambda p: group[id(p)])  # reversed groups, as ZeRO does
    assert [[p.numel() for p in b.params] for b in buckets] == [[8], [8], [2, 2]]
    order = in_arrival_order(buckets, [b2, w2, b1, w1])  # reverse registration order
    assert [b.index for b in order] == [0, 2, 1]  # w2's bucket, then the vectors (b1 arrives before w1)


def ledger_worker(rank, world_size, bucket_mb):
    """One synchronised DDP step with nothing else on the dp axis: what did the ledger see?"""
    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        model = DistributedDataParallel(make_model(False), topo.group("dp"), bucket_mb=bucket_mb)
        x, y = local_micro_batches(0, rank, world_size, 1)[0]
        before = topo.ledger.stats()
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        step = topo.ledger.since(before)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        stat = step[("dp", "all_reduce")]
        return {"grad_bytes": grad_bytes, "wire": stat.wire_bytes, "bytes": stat.bytes, "count": stat.count,
                "keys": sorted(step), "n_buckets": len(model.buckets), "early": model.early_launches}
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_comm_volume_is_ring_all_reduce_of_gradients(rank_pool, world):
    for r in rank_pool.run(ledger_worker, world, bucket_mb=0.02):
        expected = 2 * (world - 1) / world * r["grad_bytes"]
        assert abs(r["wire"] - expected) <= 0.01 * expected
        assert r["bytes"] == r["grad_bytes"]  # each gradient reduced exactly once, no padding
        assert r["count"] == r["n_buckets"] and r["keys"] == [("dp", "all_reduce")]
        # buckets are launched from gradient hooks while backward is still running
        assert 1 <= r["early"] <= r["n_buckets"]


def broadcast_worker(rank, world_size):
    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        torch.manual_seed(rank)  # every rank starts from different weights
        module = Transformer(model_config("tiny"))
        DistributedDataParallel(module, topo.group("dp"))
        return {k: v.clone() for k, v in module.state_dict().items()}
    finally:
        topo.destroy()


@pytest.mark.multirank
def test_ddp_broadcasts_rank0_state(rank_pool):
    results = rank_pool.run(broadcast_worker, 4)
    torch.manual_seed(0)
    expected = Transformer(model_config("tiny")).state_dict()
    for state in results:
        for name, value in expected.items():
            assert torch.equal(state[name], value), name


class Branchy(nn.Module):
    """Rank-dependent control flow: branch ``b`` only runs where the input says so."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        return self.b(self.a(x)) if use_b else self.a(x)


# A script is a list of backward passes (input scale, who uses branch b, under no_sync?).
BRANCHY_SCRIPTS = {
    # only rank 0 uses b: no hang, and b's gradient is g0 / N
    "partial": [(1.0, "rank0", False)],
    # b's gradient accumulates under no_sync, then the synchronised pass does not touch b
    "accumulate_then_skip": [(1.0, "all", True), (2.0, "none", False)],
}


def _uses_b(who: str, rank: int) -> bool:
    return who == "all" or (who == "rank0" and rank == 0)


def branchy_worker(rank, world_size, script):
    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(Branchy(), topo.group("dp"), find_unused_parameters=True)
        for scale, who, local in BRANCHY_SCRIPTS[script]:
            with model.no_sync() if local else contextlib.nullcontext():
                x = torch.full((2, 4), scale * (rank + 1))
                model(x, use_b=_uses_b(who, rank)).sum().backward()
        return {n: p.grad.clone() for n, p in model.module.named_parameters()}
    finally:
        topo.destroy()


def check_branchy_against_one_process(rank_pool, script, world=2):
    """One process sums every rank's passes, each divided by N: the averaged gradient DDP must give."""
    results = rank_pool.run(branchy_worker, world, script=script)
    torch.manual_seed(0)
    ref = Branchy()
    for rank in range(world):
        for scale, who, _ in BRANCHY_SCRIPTS[script]:
            ref(torch.full((2, 4), scale * (rank + 1)), use_b=_uses_b(who, rank)).sum().div(world).backward()
    for grads in results:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)


@pytest.mark.multirank
def test_ddp_parameter_used_on_some_ranks_only(rank_pool):
    check_branchy_against_one_process(rank_pool, "partial")


def torch_ddp_worker(rank, world_size):
    """tessera's DDP (reduce_op avg, like torch's) gives torch DDP's gradients on the same data."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    topo = Topology.build(ParallelConfig(dp_replicate=world_size))
    try:
        ours = DistributedDataParallel(make_model(False), topo.group("dp"), bucket_mb=0.02)
        theirs = TorchDDP(make_model(False), process_group=dist.group.WORLD, bucket_cap_mb=0.02)
        x, y = local_micro_batches(0, rank, world_size, 1)[0]
        for m in (ours, theirs):
            for _ in range(2):  # twice, to exercise gradient accumulation after a synchronised step
                nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
        return {n: (p.grad, q.grad) for (n, p), q in zip(ours.module.named_parameters(), theirs.module.parameters())}
    finally:
        topo.destroy()


@pytest.mark.multirank
def test_ddp_gradients_equal_torch_ddp(rank_pool):
    for grads in rank_pool.run(torch_ddp_worker, 2):
        for name, (ours, theirs) in grads.items():
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.multirank
def test_ddp_keeps_gradients_accumulated_before_a_pass_that_skips_them(rank_pool):
    check_branchy_against_one_process(rank_pool, "accumulate_then_skip")


def ep_settings_worker(rank, world_size, bucket_mb, find_unused):
    """``parallelize`` under expert parallelism (4 ranks: ep=2, edp=2): both reductions (dense over dp,
    experts over edp) take the [ddp] settings; ``spare`` is a dense layer the forward never calls."""
    from tessera.data_parallel import DDPConfig
    from tessera.models.moe import MoEConfig
    from tessera.parallelize import parallelize

    topo = Topology.build(ParallelConfig(dp_replicate=world_size, ep=2))
    try:
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", num_experts=4, moe_every=1), MoEConfig(top_k=1))
        model.spare = nn.Linear(4, 4)
        wrapped = parallelize(model, topo, DDPConfig(bucket_mb=bucket_mb, find_unused_parameters=find_unused))
        x, y = local_micro_batches(0, rank, world_size, 1)[0]
        forward_backward(wrapped, [(x, y)], topo.group("dp"), torch.device("cpu"))
        return {"buckets": [len(r.buckets) for r in wrapped._replicas], "spare": model.spare.weight.grad,
                "with_grad": sum(p.grad is not None for p in model.parameters())}
    finally:
        topo.destroy()


@pytest.mark.multirank
def test_expert_data_parallel_takes_the_ddp_settings(rank_pool):
    big = rank_pool.run(ep_settings_worker, 4, bucket_mb=25.0, find_unused=False)
    small = rank_pool.run(ep_settings_worker, 4, bucket_mb=0.002, find_unused=True)
    assert all(r["buckets"] == [1, 1] for r in big)
    assert all(dense > 5 and experts > 5 for r in small for dense, experts in [r["buckets"]])
    assert all(r["spare"] is not None and not r["spare"].any() for r in big)  # zeros
    assert all(r["spare"] is None for r in small)  # no rank had a gradient: None, as in one process
    assert all(r["with_grad"] == big[0]["with_grad"] - 2 for r in small)  # only spare's two lost theirs
