"""The persistent gloo rank pool: results, reuse, failures, hangs, dead workers, cleanup between tasks."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tessera.testing import RankFailure, RankTimeout

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]


# ---- bodies run on the ranks (module level, so they pickle by reference) ----

def _whoami(rank, world_size):
    return {"rank": rank, "world_size": world_size, "pid": os.getpid(), "is_init": dist.is_initialized()}


def _all_reduce(rank, world_size):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return {"sum": t, "backend": dist.get_backend(), "threads": torch.get_num_threads()}


def _echo_params(rank, world_size, *, scale, name, tensor):
    return (name, tensor * scale + rank)


def _raise_on(rank, world_size, *, ranks):
    if rank in ranks:
        raise ValueError(f"boom on rank {rank}")
    return rank


def _raise_on_1_while_0_waits(rank, world_size):
    if rank == 1:
        raise KeyError("rank 1 gave up")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone


def _block_on_rank_0(rank, world_size):
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends
    return rank


def _exit_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # blocks (or errors) once the peer is gone


def _make_groups(rank, world_size):
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    a = dist.new_group(ranks=list(range(world_size)))
    dist.new_group(ranks=list(range(world_size)))
    t = torch.ones(1)
    dist.all_reduce(t, group=a)
    return before, len(c10d._world.pg_map), t.item()


def _count_groups(rank, world_size):
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def _mess_up_settings(rank, world_size):
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)


def _settings(rank, world_size):
    return torch.get_default_dtype(), torch.get_num_threads()


class _NeedsTwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b} cannot be rebuilt by pickle")


def _raise_unpicklable(rank, world_size):
    raise _NeedsTwoArgs("this", "that")


def _return_unpicklable(rank, world_size):
    return lambda: rank


# ---- tests ----

def test_results_come_back_per_rank(rank_pool):
    out = rank_pool.run(_whoami, 2)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world_size"] == 2 and o["is_init"] for o in out)
    assert len({o["pid"] for o in out}) == 2 and os.getpid() not in {o["pid"] for o in out}


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_all_reduce(rank_pool, world_size):
    out = rank_pool.run(_all_reduce, world_size)
    expected = torch.full((3,), world_size * (world_size + 1) / 2)
    for o in out:
        torch.testing.assert_close(o["sum"], expected)
        assert o["backend"] == "gloo" and o["threads"] == 1


def test_reuses_workers_and_dispatches_fast(rank_pool):
    first = [o["pid"] for o in rank_pool.run(_whoami, 2)]
    start = time.monotonic()
    second = [o["pid"] for o in rank_pool.run(_whoami, 2)]
    assert time.monotonic() - start < 1.0
    assert first == second == rank_pool.pool(2).pids


def test_params_are_passed_through(rank_pool):
    out = rank_pool.run(_echo_params, 2, scale=3, name="x", tensor=torch.arange(3.0))
    assert [name for name, _ in out] == ["x", "x"]
    torch.testing.assert_close(out[1][1], torch.tensor([1.0, 4.0, 7.0]))


def test_exception_on_one_rank_reports_its_traceback(rank_pool):
    pids = rank_pool.pool(2).pids
    with pytest.raises(RankFailure) as info:
        rank_pool.run(_raise_on, 2, ranks=[1])
    text = str(info.value)
    assert "rank 1" in text and "boom on rank 1" in text
    assert "Traceback" in text and "_raise_on" in text and "rank 0 raised" not in text
    assert not isinstance(info.value, RankTimeout)
    assert isinstance(info.value.exceptions[1], ValueError) and set(info.value.failures) == {1}
    # every rank reported, so the pool is intact and kept
    assert [o["rank"] for o in rank_pool.run(_whoami, 2)] == [0, 1]
    assert rank_pool.pool(2).pids == pids


def test_exception_on_both_ranks_reports_both(rank_pool):
    with pytest.raises(RankFailure) as info:
        rank_pool.run(_raise_on, 2, ranks=[0, 1])
    text = str(info.value)
    for rank in (0, 1):
        assert f"--- rank {rank} raised ---" in text and f"boom on rank {rank}" in text
    assert text.count("Traceback") == 2


def test_failure_while_peer_waits_fails_fast_and_replaces_pool(rank_pool):
    pool = rank_pool.pool(2)
    generation = pool.generation
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        rank_pool.run(_raise_on_1_while_0_waits, 2, timeout=60)
    assert time.monotonic() - start < 20
    text = str(info.value)
    assert "rank 1 gave up" in text and "ranks [0] did not report" in text
    assert info.value.missing == (0,) and not isinstance(info.value, RankTimeout)
    assert [o["rank"] for o in rank_pool.run(_whoami, 2)] == [0, 1]
    assert pool.generation == generation + 1


def test_hang_raises_rank_timeout_and_next_call_works(rank_pool):
    old_pids = rank_pool.pool(2).pids
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        rank_pool.run(_block_on_rank_0, 2, timeout=5)
    elapsed = time.monotonic() - start
    assert 4.5 < elapsed < 15
    text = str(info.value)
    assert "ranks [0]" in text and "timeout=5" in text
    assert "_block_on_rank_0" in text  # the hung rank's stack, dumped through SIGUSR1
    out = rank_pool.run(_whoami, 2)
    assert [o["rank"] for o in out] == [0, 1] and set(o["pid"] for o in out).isdisjoint(old_pids)


def test_dead_worker_is_detected_quickly(rank_pool):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        rank_pool.run(_exit_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 15
    assert info.value.dead == {1: 3}
    assert "rank 1 died: worker exited with exit code 3" in str(info.value)
    assert [o["rank"] for o in rank_pool.run(_whoami, 2)] == [0, 1]


def test_groups_created_in_a_task_are_destroyed(rank_pool):
    before, during, total = rank_pool.run(_make_groups, 2)[0]
    assert during == before + 2 and total == 2.0
    assert rank_pool.run(_count_groups, 2) == [before, before]


def test_settings_are_restored_between_tasks(rank_pool):
    rank_pool.run(_mess_up_settings, 2)
    assert rank_pool.run(_settings, 2) == [(torch.float32, 1)] * 2


def test_unpicklable_exception_and_result_are_reported_as_text(rank_pool):
    with pytest.raises(RankFailure) as info:
        rank_pool.run(_raise_unpicklable, 2)
    assert "cannot be rebuilt by pickle" in str(info.value) and info.value.exceptions == {}
    with pytest.raises(RankFailure, match="could not be pickled"):
        rank_pool.run(_return_unpicklable, 2)
    assert rank_pool.run(_settings, 2) == [(torch.float32, 1)] * 2


def test_local_functions_are_refused_before_dispatch(rank_pool):
    with pytest.raises(TypeError, match="module-level function"):
        rank_pool.run(lambda rank, world_size: rank, 2)
