"""Choosing the run folder ``<out_dir>/<name>`` so that no earlier run is ever overwritten."""

from __future__ import annotations

from pathlib import Path

import torch

from tessera import comm
from tessera.topology import GRID_AXES, Topology

_SHORT = {"dp_replicate": "dpr", "dp_shard": "dps", "pp": "pp", "tp": "tp", "cp": "cp", "ep": "ep"}


def default_name(preset: str, topology: Topology) -> str:
    """e.g. ``small-dpr2`` or ``tiny-single``."""
    parts = [f"{_SHORT[a]}{topology.size(a)}" for a in (*GRID_AXES, "ep") if topology.size(a) > 1]
    return f"{preset}-{'-'.join(parts) or 'single'}"


def first_free(base: Path) -> Path:
    """``base`` if it is absent or empty, else ``base-2``, ``base-3``, …"""
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def resolve_run_dir(cfg, topology: Topology, device: torch.device) -> Path:
    """Rank 0 picks and creates the folder; the choice is broadcast so every rank uses the same one.

    With ``checkpoint.resume = "auto"`` the folder ``<out_dir>/<run.name>`` is reused as it is: a job
    restarted after a failure continues the run it belongs to."""
    base = Path(cfg.run.out_dir) / (cfg.run.name or default_name(cfg.model_preset, topology))
    world = topology.group("world")
    suffix = torch.zeros((), dtype=torch.int64, device=device)
    if world.rank == 0:
        chosen = base if cfg.checkpoint.resume == "auto" else first_free(base)
        chosen.mkdir(parents=True, exist_ok=True)
        suffix.fill_(0 if chosen == base else int(chosen.name.rsplit("-", 1)[1]))
    comm.broadcast(suffix, world, src=0)
    n = int(suffix)
    return base if n == 0 else base.with_name(f"{base.name}-{n}")
