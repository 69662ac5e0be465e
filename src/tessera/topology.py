"""Parallel degrees → a rank grid → named process groups and a DeviceMesh.

Every group is derived from ONE rank array (nanotron's habit): the world's ranks are laid out as a grid
whose dimensions are the axes of the order string, the last one varying fastest. An axis group is the set
of ranks that differ only in that axis; a flattened group (``dp`` = dp_replicate × dp_shard) varies in
several. Expert parallelism is carved out of the data-parallel ranks: the flattened data-parallel index
``d`` splits into ``d = edp_index * ep + ep_index``, so ``ep`` peers are neighbours inside ``dp``.

A degree of 1 costs nothing: its group is a size-1 ``CommGroup`` with no process group, and every
collective on it is skipped. World size 1 therefore needs no special code in callers and no
``init_process_group`` at all.

Every group carries the device its collectives' tensors must live on (the rank's accelerator under NCCL,
the CPU under gloo), which ``tessera.comm`` checks on every call, size-1 groups included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tessera.comm.group import CommGroup
from tessera.comm.ledger import CommLedger
from tessera.device import comm_device
from tessera.errors import ConfigError

GRID_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DEFAULT_ORDER = "pp-dp_replicate-dp_shard-cp-tp"

# Flattened groups built for every topology: name → the grid axes it spans.
FLAT_GROUPS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}


@dataclass
class ParallelConfig:
    """Parallel degrees. ``dp_replicate = -1`` means "whatever the world size leaves over"."""

    dp_replicate: int = -1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    timeout_s: float = 300.0  # how long a collective may wait for its peers before it raises
    zero_stage: int = 0  # 0: DDP; 1/2/3: ZeRO sharding of optimizer state / +gradients / +parameters
    auto: bool = False  # let the planner choose the degrees, zero_stage and micro-batch before ranks start

    def validate(self) -> ParallelConfig:
        """Checks that need no world size (the rest happens in :func:`validate_degrees`)."""
        parse_order(self.order)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        return self

    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in GRID_AXES}

    def resolved(self, world_size: int) -> ParallelConfig:
        """A copy with ``-1`` filled in, validated against ``world_size``; raises ConfigError."""
        validate_degrees(self, world_size)
        out = ParallelConfig(**{f.name: getattr(self, f.name) for f in fields(self)})
        if out.dp_replicate == -1:
            others = math.prod(d for a, d in self.degrees().items() if a != "dp_replicate")
            out.dp_replicate = world_size // others
        return out


def parse_order(order: str) -> tuple[str, ...]:
    axes = tuple(a.strip() for a in order.split("-"))
    if sorted(axes) != sorted(GRID_AXES):
        raise ConfigError(
            f"rank order '{order}' must name each of {', '.join(GRID_AXES)} exactly once, joined by '-'"
        )
    return axes


def validate_degrees(cfg: ParallelConfig, world_size: int) -> None:
    """Raise ConfigError with one sentence if the degrees cannot lay out ``world_size`` ranks."""
    parse_order(cfg.order)
    for axis in (*GRID_AXES, "ep"):
        value = getattr(cfg, axis)
        if value < 1 and not (axis == "dp_replicate" and value == -1):
            raise ConfigError(f"parallel.{axis} must be a positive integer, got {value}")
    if cfg.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {cfg.timeout_s}")
    degrees = cfg.degrees()
    if cfg.dp_replicate == -1:
        others = math.prod(d for a, d in degrees.items() if a != "dp_replicate")
        if world_size % others:
            raise ConfigError(
                f"the world size {world_size} is not divisible by pp×dp_shard×cp×tp = {others}, "
                f"so dp_replicate cannot be filled in"
            )
        degrees["dp_replicate"] = world_size // others
    product = math.prod(degrees.values())
    if product != world_size:
        shown = " × ".join(f"{a}={d}" for a, d in degrees.items())
        raise ConfigError(f"parallel degrees {shown} multiply to {product}, not the world size {world_size}")
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    if dp % cfg.ep:
        raise ConfigError(
            f"expert parallelism ep={cfg.ep} must divide the data-parallel degree "
            f"dp_replicate×dp_shard = {dp}, since experts are carved out of data-parallel ranks"
        )


def rank_grid(cfg: ParallelConfig) -> tuple[np.ndarray, tuple[str, ...]]:
    """The world's ranks as an array with one dimension per axis, in rank order (last = fastest)."""
    order = parse_order(cfg.order)
    shape = [getattr(cfg, a) for a in order]
    return np.arange(math.prod(shape)).reshape(shape), order


def axis_partition(grid: np.ndarray, order: tuple[str, ...], axes: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Partition of all ranks into groups that vary exactly along ``axes`` (ranks ordered by index).

    The varying axes are moved last (in the order they are given, the last fastest) and the array is
    reshaped to (groups, group_size); each row is one group.
    """
    dims = [order.index(a) for a in axes]
    rest = [i for i in range(len(order)) if i not in dims]
    moved = np.transpose(grid, rest + dims)
    size = math.prod(grid.shape[d] for d in dims)
    return [tuple(int(r) for r in row) for row in moved.reshape(-1, size)]


def expert_partitions(grid: np.ndarray, order: tuple[str, ...], ep: int) -> dict[str, list[tuple[int, ...]]]:
    """``ep`` and ``edp`` (expert-data-parallel) partitions, carved from the flattened dp groups, and
    ``edp_cp``: the ranks holding the same experts and different tokens under context parallelism
    (edp × cp), over which expert gradients are summed."""
    ep_groups, edp_groups, edp_cp_groups = [], [], []
    for dp_ranks in axis_partition(grid, order, FLAT_GROUPS["dp"]):
        block = np.array(dp_ranks).reshape(-1, ep)  # [dp/ep, ep]: dp index = edp_index * ep + ep_index
        ep_groups += [tuple(int(r) for r in row) for row in block]
        edp_groups += [tuple(int(r) for r in col) for col in block.T]
    cp = grid.shape[order.index("cp")]
    for ranks in axis_partition(grid, order, FLAT_GROUPS["dp_cp"]):  # cp varies fastest in a dp_cp row
        block = np.array(ranks).reshape(-1, ep, cp)  # dp_cp index = (edp_index * ep + ep_index) * cp + cp_index
        edp_cp_groups += [tuple(sorted(int(r) for r in block[:, e, :].flatten())) for e in range(ep)]
    return {"ep": sorted(ep_groups), "edp": sorted(edp_groups), "edp_cp": sorted(edp_cp_groups)}


class Topology:
    """The parallel layout of one job: degrees, this rank's coordinates, and one CommGroup per axis.

    Groups: each grid axis (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``), the flattened
    ``dp``, ``dp_cp`` and ``dp_shard_cp``, ``ep`` / ``edp`` / ``edp_cp`` for expert parallelism, and ``world``. Ranks of a group
    appear in ascending order, so a group's local rank follows the global rank.
    """

    def __init__(self, cfg: ParallelConfig, world_size: int, rank: int, partitions, groups, ledger,
                 device: torch.device = torch.device("cpu")):
        self.config = cfg
        self.device = device  # every group's device
        self.world_size = world_size
        self.rank = rank
        self.ledger = ledger
        self.partitions: dict[str, list[tuple[int, ...]]] = partitions
        self._groups: dict[str, CommGroup] = groups
        self._mesh = None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: ParallelConfig, ledger: CommLedger | None = None,
              device: torch.device | str | None = None) -> Topology:
        """Create the groups collectively (every rank must call this, in the same order).

        Without an initialised process group the world is one rank and no group is created. ``device``
        is the groups' device, where every tensor handed to their collectives must live; by default the
        one the default process group's backend uses (the current accelerator for NCCL, else the CPU).
        A one-process run on an accelerator passes its device (there is no backend to derive it from).
        """
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        device = torch.device(device) if device is not None else comm_device(
            dist.get_backend() if dist.is_initialized() else None)
        cfg = cfg.resolved(world_size)
        ledger = ledger if ledger is not None else CommLedger()
        partitions = cls.layout(cfg)
        timeout = timedelta(seconds=cfg.timeout_s)
        pgs: dict[tuple[int, ...], object] = {}  # identical rank sets share one process group
        groups = {}
        for name, parts in partitions.items():
            mine = next(p for p in parts if rank in p)
            # Decided from the whole partition, identical on every rank, so all ranks agree on
            # whether to create groups (creation is collective).
            if len(mine) > 1 and not all(p in pgs for p in parts):
                pgs.update(_new_partition(parts, timeout))
            groups[name] = CommGroup(name, pgs.get(mine), mine, rank, ledger, timeout, device)
        return cls(cfg, world_size, rank, partitions, groups, ledger, groups["world"].device)  # with its index

    @staticmethod
    def layout(cfg: ParallelConfig) -> dict[str, list[tuple[int, ...]]]:
        """Every named partition of the ranks; pure, so it can be checked without processes."""
        grid, order = rank_grid(cfg)
        parts = {axis: axis_partition(grid, order, (axis,)) for axis in GRID_AXES}
        for name, axes in FLAT_GROUPS.items():
            parts[name] = axis_partition(grid, order, axes)
        parts.update(expert_partitions(grid, order, cfg.ep))
        parts["world"] = [tuple(int(r) for r in grid.flatten())]
        return parts

    # ---- queries ------------------------------------------------------------------------------
    def group(self, name: str) -> CommGroup:
        try:
            return self._groups[name]
        except KeyError:
            raise KeyError(f"no group '{name}'; known groups: {', '.join(self._groups)}") from None

    def size(self, name: str) -> int:
        return self._groups[name].size

    def coord(self, name: str) -> int:
        """This rank's index along an axis (its local rank in that group)."""
        return self._groups[name].rank

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def describe(self) -> str:
        degrees = " ".join(f"{a}={self.size(a)}" for a in (*GRID_AXES, "ep") if self.size(a) > 1)
        return f"{self.world_size} rank(s): {degrees or 'single process'} (order {self.config.order})"

    def device_mesh(self, device_type: str | None = None):
        """A torch DeviceMesh over the axes of degree > 1, named by axis, reusing this topology's groups
        (on the groups' device type unless ``device_type`` is given).

        Used by DTensor-based baselines; returns None when the world is one rank.
        """
        device_type = device_type or self.device.type
        if self._mesh is None and self.world_size > 1:
            from torch.distributed.device_mesh import DeviceMesh

            grid, order = rank_grid(self.config)
            keep = [a for a in order if self.size(a) > 1]
            mesh = grid.reshape([self.size(a) for a in keep])
            pgs = [self._groups[a].pg for a in keep]
            self._mesh = DeviceMesh.from_group(
                pgs if len(pgs) > 1 else pgs[0], device_type, mesh=mesh.tolist(), mesh_dim_names=tuple(keep)
            )
        return self._mesh

    def destroy(self) -> None:
        """Destroy the process groups this topology created (not the default group)."""
        seen = set()
        for g in self._groups.values():
            if g.pg is not None and id(g.pg) not in seen and g.pg is not dist.GroupMember.WORLD:
                seen.add(id(g.pg))
                dist.destroy_process_group(g.pg)
        self._groups = {name: CommGroup(name, None, (self.rank,), self.rank, self.ledger, g.timeout, g.device)
                        for name, g in self._groups.items()}


def _new_partition(parts: list[tuple[int, ...]], timeout: timedelta) -> dict[tuple[int, ...], object]:
    """Create one process group per part; every rank must call this with the same ``parts``."""
    world = dist.get_world_size()
    if len(parts) == 1 and len(parts[0]) == world:
        return {parts[0]: dist.GroupMember.WORLD}
    _, all_groups = dist.new_subgroups_by_enumeration([list(p) for p in parts], timeout=timeout)
    return {p: pg for p, pg in zip(parts, all_groups)}
