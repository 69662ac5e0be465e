"""Process grids over the tp ranks for Colossal-AI's 2D (q×q), 2.5D (q×q×d) and 3D (q×q×q) layers.

A tp group of q²·d (or q³) ranks is laid out with the last coordinate fastest. Every rank of the WORLD
must build every grid in the same order (creating a process group is collective), so the builders take
the whole tp partition (``Topology.partitions["tp"]``), not just this rank's group.

    2D / 2.5D: tp-local rank t → (dep, i, j) = (t // q², t // q % q, t % q)
        row   = ranks with the same (dep, i), varying j   (axis "tp_row")
        col   = ranks with the same (dep, j), varying i   (axis "tp_col")
        depth = ranks with the same (i, j), varying dep   (axis "tp_dep"; size 1 for 2D)
    3D: t → (i, j, l) = (t // q², t // q % q, t % q); groups x, y, z vary i, j, l (axes "tp_x", "tp_y", "tp_z")
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from tessera.comm.group import CommGroup
from tessera.errors import ConfigError


def _groups(tp: CommGroup, tp_partition, shape: tuple[int, ...], axis_names: tuple[str, ...]):
    """One CommGroup per grid axis for this rank; creates the process groups of every tp group."""
    mine: dict[str, CommGroup] = {}
    for a, name in enumerate(axis_names):
        parts = []
        for ranks in tp_partition:
            coords = [_unravel(t, shape) for t in range(len(ranks))]
            keys = sorted({tuple(c[:a] + c[a + 1:]) for c in coords})
            for key in keys:
                parts.append(tuple(ranks[t] for t, c in enumerate(coords) if tuple(c[:a] + c[a + 1:]) == key))
        part = next(p for p in parts if tp.global_rank in p)
        pg = None
        if shape[a] > 1:
            pg, _ = dist.new_subgroups_by_enumeration([list(p) for p in parts], timeout=tp.timeout)
        mine[name] = CommGroup(name, pg, part, tp.global_rank, tp.ledger, tp.timeout, tp.device)
    return mine


def _unravel(t: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(t % size)
        t //= size
    return out[::-1]


@dataclass
class Grid2D:
    """A q×q (×d) grid: SUMMA runs along ``row`` and ``col``; ``depth`` replicates weights (2.5D)."""

    q: int
    d: int
    row: CommGroup
    col: CommGroup
    depth: CommGroup

    @property
    def i(self) -> int:  # grid row of this rank
        return self.col.rank

    @property
    def j(self) -> int:  # grid column
        return self.row.rank

    @property
    def batch_block(self) -> int:
        """Which of the d·q batch slices this rank's activations hold."""
        return self.depth.rank * self.q + self.i

    @classmethod
    def build(cls, tp: CommGroup, tp_partition, depth: int = 1) -> Grid2D:
        q = math.isqrt(tp.size // depth)
        if depth < 1 or q * q * depth != tp.size:
            raise ConfigError(f"2D/2.5D tensor parallelism needs tp = q²·d ranks; tp={tp.size} with d={depth} is not.")
        g = _groups(tp, tp_partition, (depth, q, q), ("tp_dep", "tp_col", "tp_row"))
        return cls(q, depth, g["tp_row"], g["tp_col"], g["tp_dep"])


@dataclass
class Grid3D:
    """A q×q×q cube; a 3D linear gathers its input along one axis, its weight along another and
    reduce-scatters its output along the third."""

    q: int
    x: CommGroup
    y: CommGroup
    z: CommGroup

    @property
    def batch_block(self) -> int:
        """Batch slice (of q²) a transformer block's input holds: (i, j)."""
        return self.x.rank * self.q + self.y.rank

    @classmethod
    def build(cls, tp: CommGroup, tp_partition) -> Grid3D:
        q = round(tp.size ** (1 / 3))
        if q**3 != tp.size:
            raise ConfigError(f"3D tensor parallelism needs tp = q³ ranks; tp={tp.size} is not a cube.")
        g = _groups(tp, tp_partition, (q, q, q), ("tp_x", "tp_y", "tp_z"))
        return cls(q, g["tp_x"], g["tp_y"], g["tp_z"])
