"""Topology: validation (pure tier) and group layout up to 64 ranks with torch's fake backend (tier 2)."""

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from tessera.device import comm_device
from tessera.errors import ConfigError
from tessera.topology import GRID_AXES, ParallelConfig, Topology, parse_order, validate_degrees


# ---- tier 1: validation ------------------------------------------------------------------------
def test_product_must_equal_world_size():
    with pytest.raises(ConfigError, match="multiply to 8, not the world size 4"):
        validate_degrees(ParallelConfig(dp_replicate=2, tp=2, pp=2), 4)


def test_dp_replicate_fills_the_rest():
    cfg = ParallelConfig(tp=2, pp=2).resolved(8)
    assert cfg.dp_replicate == 2
    with pytest.raises(ConfigError, match="not divisible"):
        ParallelConfig(tp=3).resolved(4)


def test_ep_must_divide_data_parallel_degree():
    with pytest.raises(ConfigError, match="ep=3 must divide"):
        validate_degrees(ParallelConfig(dp_replicate=2, dp_shard=2, ep=3), 4)
    validate_degrees(ParallelConfig(dp_replicate=2, dp_shard=2, ep=4), 4)


@pytest.mark.parametrize("order", ["pp-dp_replicate-dp_shard-cp", "tp-tp-pp-cp-dp_shard", "pp-dp-dp_shard-cp-tp"])
def test_bad_order_string(order):
    with pytest.raises(ConfigError, match="exactly once"):
        parse_order(order)


def test_non_positive_degree():
    with pytest.raises(ConfigError, match="parallel.tp must be a positive integer"):
        validate_degrees(ParallelConfig(tp=0), 1)


def test_world_size_one_needs_no_process_group():
    assert not dist.is_initialized()
    topo = Topology.build(ParallelConfig())
    assert topo.world_size == 1 and topo.describe().endswith("single process (order pp-dp_replicate-dp_shard-cp-tp)")
    for name in topo.names:
        g = topo.group(name)
        assert g.size == 1 and g.pg is None and g.rank == 0
    assert topo.device_mesh() is None


def test_groups_carry_the_device_their_tensors_must_live_on():
    """Derived from the backend (gloo, fake, none: the CPU; NCCL: the rank's accelerator, see test_gpu.py),
    or given; every group of a topology has it, size-1 groups too, and keeps it after destroy()."""
    assert [comm_device(b) for b in (None, "gloo", "fake")] == [torch.device("cpu")] * 3
    assert {Topology.build(ParallelConfig()).group(n).device for n in GRID_AXES} == {torch.device("cpu")}
    topo = Topology.build(ParallelConfig(), device="meta")
    assert topo.device == torch.device("meta")
    assert {topo.group(n).device for n in topo.names} == {torch.device("meta")}
    topo.destroy()
    assert topo.group("dp").device == torch.device("meta")


def test_layout_is_a_partition_for_every_axis():
    cfg = ParallelConfig(dp_replicate=2, dp_shard=2, pp=2, tp=2, cp=2, ep=4)
    for name, parts in Topology.layout(cfg).items():
        flat = sorted(r for p in parts for r in p)
        assert flat == list(range(32)), name
        assert len({len(p) for p in parts}) == 1, name


def test_tp_is_fastest_varying_by_default():
    parts = Topology.layout(ParallelConfig(dp_replicate=2, tp=4))
    assert parts["tp"] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert parts["dp_replicate"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    reordered = Topology.layout(ParallelConfig(dp_replicate=2, tp=4, order="tp-cp-dp_shard-pp-dp_replicate"))
    assert reordered["dp_replicate"] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_expert_groups_are_carved_from_data_parallel_ranks():
    parts = Topology.layout(ParallelConfig(dp_replicate=2, dp_shard=2, tp=2, ep=2))
    assert parts["dp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert parts["ep"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert parts["edp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]


# ---- tier 2: the fake backend plays rank r of N ------------------------------------------------
def _build_as(rank: int, world: int, cfg: ParallelConfig) -> Topology:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return Topology.build(cfg)


def _strides(cfg: ParallelConfig) -> dict[str, int]:
    order = parse_order(cfg.order)
    sizes = [getattr(cfg, a) for a in order]
    return {a: math.prod(sizes[i + 1 :]) for i, a in enumerate(order)}


def all_layouts(world_size: int, max_axes: int):
    """Every ParallelConfig (ep = 1) of ``world_size`` ranks with at most ``max_axes`` axes above 1."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for combo in itertools.product(divisors, repeat=len(GRID_AXES)):
        if math.prod(combo) == world_size and sum(d > 1 for d in combo) <= max_axes:
            yield ParallelConfig(**dict(zip(GRID_AXES, combo)))


def _check_layout(cfg: ParallelConfig, world: int, ranks) -> None:
    """Play each of ``ranks`` in turn and check its view of the layout."""
    for rank in ranks:
        topo = _build_as(rank, world, cfg)
        try:
            _check_rank(topo, cfg)
        finally:
            topo.destroy()
            dist.destroy_process_group()


def _check_rank(topo: Topology, cfg: ParallelConfig) -> None:
    strides = _strides(cfg)
    # the rank is the dot product of its coordinates with the strides of the order string
    assert sum(topo.coord(a) * strides[a] for a in GRID_AXES) == topo.rank
    for name in topo.names:
        g = topo.group(name)
        assert topo.rank in g.ranks and g.ranks[g.rank] == topo.rank
        assert g.device == torch.device("cpu")  # derived from the (fake) backend: no accelerator
        if g.size > 1:
            assert tuple(dist.get_process_group_ranks(g.pg)) == g.ranks
        else:
            assert g.pg is None  # a degree of 1 costs no process group
    for axis in GRID_AXES:
        g = topo.group(axis)
        assert g.size == getattr(cfg, axis)
        assert all(b - a == strides[axis] for a, b in zip(g.ranks, g.ranks[1:]))
    assert topo.size("dp") == cfg.dp_replicate * cfg.dp_shard
    assert topo.size("ep") * topo.size("edp") == topo.size("dp")
    assert set(topo.group("ep").ranks) <= set(topo.group("dp").ranks)
    mesh = topo.device_mesh()
    if mesh is not None:
        assert list(mesh.get_coordinate()) == [topo.coord(a) for a in mesh.mesh_dim_names]


LAYOUTS_64 = [
    ParallelConfig(dp_replicate=2, dp_shard=2, pp=4, tp=2, cp=2, ep=2),
    ParallelConfig(dp_replicate=1, dp_shard=8, pp=2, tp=4, ep=8),
    ParallelConfig(dp_replicate=4, dp_shard=1, pp=2, tp=8, order="tp-cp-dp_shard-dp_replicate-pp"),
    ParallelConfig(dp_replicate=64),
]


@pytest.mark.parametrize("cfg", LAYOUTS_64, ids=lambda c: "x".join(f"{a}{getattr(c, a)}" for a in GRID_AXES))
def test_fake_layout_64_ranks(cfg):
    _check_layout(cfg, 64, range(64))


def test_fake_every_layout_of_16_ranks():
    """Every way to lay out 16 ranks on up to three axes, played from three ranks each."""
    layouts = list(all_layouts(16, max_axes=3))
    assert len(layouts) > 30
    for cfg in layouts:
        _check_layout(cfg, 16, (0, 7, 15))
