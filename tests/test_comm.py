"""tessera.comm on real gloo ranks: results, ledger accounting, size-1 skipping, autograd, timeouts, and
the check that every tensor lives on its group's device."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tessera import comm
from tessera.comm import CommGroup, CommLedger, P2POp
from tessera.errors import CommTimeoutError

pytestmark = pytest.mark.multirank


def world_group(rank: int, world: int, axis: str = "dp") -> CommGroup:
    return CommGroup(axis, dist.group.WORLD, tuple(range(world)), rank, CommLedger())


def collectives_worker(rank, world_size):
    g = world_group(rank, world_size)
    n = world_size
    out = {}
    t = torch.full((6,), float(rank + 1))
    comm.all_reduce(t, g)
    out["all_reduce"] = t
    t = torch.full((6,), float(rank + 1))
    comm.all_reduce(t, g, op="avg")
    out["avg"] = t
    t = torch.full((3,), float(rank))
    comm.broadcast(t, g, src=n - 1)
    out["broadcast"] = t
    t = torch.full((2,), float(rank + 1))
    comm.reduce(t, g, dst=0)
    out["reduce"] = t if rank == 0 else None
    gathered = torch.empty(2 * n)
    comm.all_gather(gathered, torch.full((2,), float(rank)), g)
    out["all_gather"] = gathered
    shard = torch.empty(2)
    comm.reduce_scatter(shard, torch.arange(2.0 * n) * (rank + 1), g)
    out["reduce_scatter"] = shard
    out["gather"] = comm.gather(torch.tensor([float(rank)]), g, dst=0)
    piece = torch.empty(2)
    comm.scatter(piece, [torch.full((2,), 10.0 + j) for j in range(n)] if rank == 0 else None, g, src=0)
    out["scatter"] = piece
    handle = comm.all_reduce(torch.ones(4), g, async_op=True)
    handle.wait()
    out["ledger"] = {k: (s.count, s.bytes, s.wire_bytes) for k, s in g.ledger.stats().items()}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_compute_and_record(rank_pool, world):
    total = sum(range(1, world + 1))
    for rank, out in enumerate(rank_pool.run(collectives_worker, world)):
        assert out["all_reduce"].tolist() == [float(total)] * 6
        assert out["avg"].tolist() == pytest.approx([total / world] * 6)
        assert out["broadcast"].tolist() == [float(world - 1)] * 3
        if rank == 0:
            assert out["reduce"].tolist() == [float(total)] * 2
            assert [t.item() for t in out["gather"]] == list(range(world))
        else:
            assert out["gather"] is None
        assert out["all_gather"].tolist() == [float(r) for r in range(world) for _ in range(2)]
        assert out["reduce_scatter"].tolist() == [float(total * (2 * rank + j)) for j in range(2)]
        assert out["scatter"].tolist() == [10.0 + rank] * 2
        ledger, f = out["ledger"], (world - 1) / world
        assert ledger[("dp", "all_reduce")] == (3, 24 + 24 + 16, pytest.approx(2 * f * 64))
        assert ledger[("dp", "all_gather")] == (1, 8 * world, pytest.approx(f * 8 * world))
        assert ledger[("dp", "reduce_scatter")] == (1, 8 * world, pytest.approx(f * 8 * world))
        assert ledger[("dp", "broadcast")] == (1, 12, 12.0)
        root_wire = 4.0 * (world - 1) if rank == 0 else 4.0
        assert ledger[("dp", "gather")] == (1, 4 * world, root_wire)


def exchange_reduce_scatter_worker(rank, world_size):
    """A sum reduce-scatter on gloo (a point-to-point exchange of the chunks) against the rank-order sum of
    every rank's input and against gloo's own call (an average, which keeps it), on the same random
    [N·n, 3] inputs, synchronous and asynchronous, two in flight at once."""
    g = world_group(rank, world_size)
    torch.manual_seed(rank)
    x = torch.randn(world_size * 5, 3)
    kept = x.clone()
    every = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(every, x)
    by_rank_order = every[0].clone()
    for other in every[1:]:
        by_rank_order += other
    mine = by_rank_order[rank * 5:(rank + 1) * 5]
    sync, first, second = torch.empty(5, 3), torch.empty(5, 3), torch.empty(5, 3)
    comm.reduce_scatter(sync, x, g)
    pending = [comm.reduce_scatter(first, x, g, async_op=True), comm.reduce_scatter(second, 2 * x, g, async_op=True)]
    for handle in reversed(pending):
        handle.wait()
    stat = g.ledger.stats()[("dp", "reduce_scatter")]
    mean = torch.empty(5, 3)
    comm.reduce_scatter(mean, x, g, op="avg")
    return {"backend": g.backend, "mine": mine, "sync": sync, "async": (first, second), "mean": mean,
            "input_kept": torch.equal(x, kept), "ledger": (stat.count, stat.bytes, stat.wire_bytes)}


@pytest.mark.parametrize("world", [2, 4])
def test_a_sum_reduce_scatter_on_gloo_is_the_rank_order_sum(rank_pool, world):
    for out in rank_pool.run(exchange_reduce_scatter_worker, world):
        assert out["backend"] == "gloo"
        assert torch.equal(out["sync"], out["mine"]) and torch.equal(out["async"][0], out["mine"])
        assert torch.equal(out["async"][1], 2 * out["mine"])  # two exchanges in flight did not mix
        assert out["input_kept"]  # the exchange only reads its input
        torch.testing.assert_close(out["mean"], out["mine"] / world)
        n_bytes = world * 5 * 3 * 4  # the ledger counts the three sums' full inputs alike
        assert out["ledger"] == (3, 3 * n_bytes, pytest.approx(3 * (world - 1) / world * n_bytes))


def all_to_all_worker(rank, world_size):
    g = world_group(rank, world_size, axis="ep")
    # rank r sends (j + 1) rows of value 100·r + j to rank j: uneven splits both ways
    in_splits = [j + 1 for j in range(world_size)]
    x = torch.cat([torch.full((j + 1, 2), 100.0 * rank + j) for j in range(world_size)])
    out_splits = [rank + 1] * world_size
    y = torch.empty(sum(out_splits), 2)
    comm.all_to_all(y, x, g, output_split_sizes=out_splits, input_split_sizes=in_splits)
    stat = g.ledger.total("ep", "all_to_all")
    return y, stat.wire_bytes


def test_all_to_all_uneven_splits(rank_pool):
    world = 4
    for rank, (y, wire) in enumerate(rank_pool.run(all_to_all_worker, world)):
        expected = torch.cat([torch.full((rank + 1, 2), 100.0 * src + rank) for src in range(world)])
        assert torch.equal(y, expected)
        sent_rows = sum(j + 1 for j in range(world)) - (rank + 1)
        assert wire == sent_rows * 2 * 4


def p2p_worker(rank, world_size):
    g = world_group(rank, world_size, axis="pp")
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    got = torch.empty(3)
    if rank % 2 == 0:  # blocking send/recv around the ring, even ranks first so nobody deadlocks
        comm.send(torch.full((3,), float(rank)), g, nxt)
        comm.recv(got, g, prv)
    else:
        comm.recv(got, g, prv)
        comm.send(torch.full((3,), float(rank)), g, nxt)
    a, b = torch.empty(2), torch.empty(2)
    handles = [comm.isend(torch.full((2,), float(rank)), g, nxt), comm.irecv(a, g, prv)]
    for h in handles:
        h.wait()
    for h in comm.batch_isend_irecv([P2POp("send", torch.full((2,), -float(rank)), prv),
                                     P2POp("recv", b, nxt)], g):
        h.wait()
    return got, a, b, g.ledger.total("pp", "send").bytes, g.ledger.total("pp", "recv").bytes


def test_send_recv_sync_async_and_batched(rank_pool):
    world = 4
    for rank, (got, a, b, sent, received) in enumerate(rank_pool.run(p2p_worker, world)):
        prv, nxt = (rank - 1) % world, (rank + 1) % world
        assert got.tolist() == [float(prv)] * 3 and a.tolist() == [float(prv)] * 2
        assert b.tolist() == [-float(nxt)] * 2
        assert sent == received == 12 + 8 + 8


def test_size_one_group_skips_communication():
    g = CommGroup.single("tp")
    t = torch.arange(4.0)
    comm.all_reduce(t, g)
    comm.broadcast(t, g)
    out = torch.empty(4)
    comm.all_gather(out, t, g)
    comm.reduce_scatter(out, t * 2, g)
    comm.all_to_all(out, t, g)
    assert comm.all_reduce(t, g, async_op=True).done
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0] and out.tolist() == t.tolist()
    assert comm.gather(t, g)[0].tolist() == t.tolist()
    assert g.ledger.stats() == {}  # nothing was sent, nothing recorded
    x = torch.randn(3, requires_grad=True)
    assert comm.copy_to(x, g) is x and comm.reduce_from(x, g) is x
    with pytest.raises(ValueError, match="needs a peer"):
        comm.send(t, g, 0)


def autograd_worker(rank, world_size):
    g = world_group(rank, world_size, axis="tp")
    torch.manual_seed(0)
    full = torch.randn(3, 4 * world_size)  # the same on every rank
    w = torch.randn(3, 4 * world_size)
    x = full.clone().requires_grad_()
    # scatter_to → local piece; gather_from → full again; the loss weights each element by w
    y = comm.gather_from(comm.scatter_to(x, g, dim=-1), g, dim=-1)
    (y * w).sum().backward()
    grad_gather = x.grad.clone()
    # copy_to forwards identity and all-reduces the gradient; reduce_from sums partial results
    x2 = full.clone().requires_grad_()
    z = comm.reduce_from(comm.copy_to(x2, g) * (rank + 1), g)
    (z * w).sum().backward()
    return y.detach(), grad_gather, z.detach(), x2.grad, full, w


def test_autograd_collectives_forward_and_backward(rank_pool):
    world = 2
    total = sum(range(1, world + 1))
    for rank, (y, grad_gather, z, grad_copy, full, w) in enumerate(rank_pool.run(autograd_worker, world)):
        assert torch.equal(y, full)
        # the gradient of the gathered copy reaches x only through this rank's slice, then is
        # all-gathered back by scatter_to's backward: the whole of w
        torch.testing.assert_close(grad_gather, w)
        torch.testing.assert_close(z, full * total)
        # z = Σ_r (r+1)·x, so dz/dx = total·w, assembled by copy_to's backward all-reduce
        torch.testing.assert_close(grad_copy, w * total)


def timeout_worker(rank, world_size):
    pg = dist.new_group([0, 1], timeout=timedelta(seconds=1.5))
    g = CommGroup("tp", pg, (0, 1), rank, CommLedger(), timedelta(seconds=1.5))
    comm.all_reduce(torch.ones(2), g)  # call #1 completes
    message = None
    if rank == 0:  # rank 1 never joins call #2
        try:
            comm.all_reduce(torch.ones(2), g)
        except CommTimeoutError as err:
            message = str(err)
    dist.barrier()  # on the default group, which stays healthy
    dist.destroy_process_group(pg)
    return message


def test_collective_that_cannot_complete_names_rank_op_axis_and_call(rank_pool):
    message = rank_pool.run(timeout_worker, 2, timeout=60)[0]
    assert message is not None
    assert message.startswith("rank 0: all_reduce call #2 on axis 'tp'")
    assert "within 1.5 s" in message and "#1 all_reduce" in message


# ---- every tensor lives on its group's device ----------------------------------------------------
def _call(op: str, t: torch.Tensor, g: CommGroup):
    out = torch.empty_like(t)
    calls = {
        "all_reduce": lambda: comm.all_reduce(t, g), "broadcast": lambda: comm.broadcast(t, g),
        "reduce": lambda: comm.reduce(t, g), "all_gather": lambda: comm.all_gather(out, t, g),
        "reduce_scatter": lambda: comm.reduce_scatter(out, t, g), "all_to_all": lambda: comm.all_to_all(out, t, g),
        "gather": lambda: comm.gather(t, g), "scatter": lambda: comm.scatter(out, [t], g),
        "copy_to": lambda: comm.copy_to(t, g), "reduce_from": lambda: comm.reduce_from(t, g),
        "gather_from": lambda: comm.gather_from(t, g), "scatter_to": lambda: comm.scatter_to(t, g),
        "send": lambda: comm.send(t, g, 0),
    }
    return calls[op]()


OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
       "copy_to", "reduce_from", "gather_from", "scatter_to", "send"]


@pytest.mark.parametrize("op", OPS)
def test_tensor_off_the_group_device_fails_in_one_sentence_even_on_one_rank(op):
    g = CommGroup.single("tp", device="meta")  # a group declared on another device than the tensor's
    with pytest.raises(comm.DeviceMismatchError) as err:
        _call(op, torch.ones(4), g)
    message = str(err.value)
    assert message.startswith(f"rank 0: {op} on axis 'tp' (ranks [0]) was handed a tensor on cpu but the "
                              f"group's device is meta")
    assert "\n" not in message and message.count(". ") == 0
    assert (err.value.rank, err.value.op, err.value.axis, err.value.cause) == (0, op, "tp", "device")
    assert g.ledger.stats() == {} and g.seq == 0  # nothing was issued
    _call(op, torch.ones(4, device="meta"), g) if op != "send" else None  # the group's device passes


def device_check_worker(rank, world_size):
    """A batched exchange with a stray tensor raises on every rank before anything is posted, so no rank
    hangs and the group stays usable."""
    g = world_group(rank, world_size, axis="pp")
    peer = 1 - rank
    stray = torch.zeros(2, device="meta")
    try:
        comm.batch_isend_irecv([P2POp("send", torch.ones(2), peer), P2POp("recv", stray, peer)], g)
    except comm.DeviceMismatchError as err:
        caught = str(err)
    t = torch.full((2,), float(rank + 1))
    comm.all_reduce(t, g)
    return caught, t.tolist(), g.seq


def test_batched_exchange_with_a_stray_tensor_fails_before_posting(rank_pool):
    for rank, (message, reduced, seq) in enumerate(rank_pool.run(device_check_worker, 2)):
        assert message.startswith(f"rank {rank}: recv on axis 'pp' (ranks [0, 1]) was handed a tensor on meta")
        assert reduced == [3.0, 3.0] and seq == 1  # only the all-reduce was issued


def broadcast_gather_worker(rank, world_size):
    """All-gathers at and above the size gloo's broadcasts take over, against the same data gathered
    below it (gloo's own call), synchronous and asynchronous, from a separate input and in place."""
    from tessera.comm.gloo import BROADCAST_GATHER_BYTES, gathers_by_broadcast

    g = world_group(rank, world_size)
    n = BROADCAST_GATHER_BYTES // 4 // world_size + 3  # rows of one float: the output passes the threshold
    mine = torch.arange(n, dtype=torch.float32) + 1000.0 * rank
    big, pending, in_place = torch.empty(world_size * n), torch.empty(world_size * n), torch.zeros(world_size * n)
    comm.all_gather(big, mine, g)
    comm.all_gather(pending, mine, g, async_op=True).wait()
    in_place[rank * n:(rank + 1) * n] = mine
    comm.all_gather(in_place, in_place[rank * n:(rank + 1) * n], g)
    small = torch.empty(world_size * 4)
    comm.all_gather(small, mine[:4].clone(), g)
    stat = g.ledger.stats()[("dp", "all_gather")]
    return {"n": n, "big": big, "async": pending, "in_place": in_place, "small": small,
            "ledger": (stat.count, stat.bytes), "paths": (gathers_by_broadcast(g, big), gathers_by_broadcast(g, small))}


@pytest.mark.parametrize("world", [2, 4])
def test_large_all_gathers_run_as_broadcasts_with_the_same_result(rank_pool, world):
    for out in rank_pool.run(broadcast_gather_worker, world):
        n = out["n"]
        want = torch.cat([torch.arange(n, dtype=torch.float32) + 1000.0 * r for r in range(world)])
        assert torch.equal(out["big"], want) and torch.equal(out["async"], want)
        assert torch.equal(out["in_place"], want)
        assert torch.equal(out["small"], torch.cat([want[r * n:r * n + 4] for r in range(world)]))
        assert out["ledger"] == (4, 3 * 4 * world * n + 4 * 4 * world)
        assert out["paths"] == (True, False)  # the large ones ran as broadcasts, the small one as gloo's call
