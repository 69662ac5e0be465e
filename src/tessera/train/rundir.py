"""Choosing the run folder ``<out_dir>/<name>`` so that no earlier run is ever overwritten.

The launcher checks (``--dry-run``) or creates the folder before any rank starts, so a folder that cannot
be made is one sentence and exit code 2; rank 0 then chooses it again by the same rule (it finds the
folder empty, or the one ``checkpoint.resume = "auto"`` reuses) and broadcasts its choice, so every rank
writes into ONE folder — also under torchrun, where no launcher process of ours runs first.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tessera import comm
from tessera.errors import ConfigError
from tessera.topology import GRID_AXES, ParallelConfig, Topology

_SHORT = {"dp_replicate": "dpr", "dp_shard": "dps", "pp": "pp", "tp": "tp", "cp": "cp", "ep": "ep"}


def default_name(preset: str, parallel: ParallelConfig) -> str:
    """e.g. ``small-dpr2`` or ``tiny-single``; ``parallel`` holds resolved degrees."""
    parts = [f"{_SHORT[a]}{getattr(parallel, a)}" for a in (*GRID_AXES, "ep") if getattr(parallel, a) > 1]
    return f"{preset}-{'-'.join(parts) or 'single'}"


def first_free(base: Path) -> Path:
    """``base`` if it is absent or empty, else ``base-2``, ``base-3``, …"""
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def run_dir_base(cfg, parallel: ParallelConfig) -> Path:
    """``<out_dir>/<run.name>``, the name defaulting to ``<preset>-<layout>``."""
    return Path(cfg.run.out_dir) / (cfg.run.name or default_name(cfg.model_preset, parallel))


def choose_run_dir(cfg, parallel: ParallelConfig) -> Path:
    """The folder a run uses: ``<out_dir>/<run.name>`` itself with ``checkpoint.resume = "auto"`` (a
    restarted job continues its run), else the first free one of it, ``-2``, ``-3``, … (OSError if the
    file system cannot be read there)."""
    base = run_dir_base(cfg, parallel)
    return base if cfg.checkpoint.resume == "auto" else first_free(base)


def _cannot(path: Path, err: OSError | str) -> ConfigError:
    why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return ConfigError(f"run.out_dir: the run folder {path} cannot be created ({why}); choose another "
                       f"run.out_dir")


def prepare_run_dir(cfg, parallel: ParallelConfig, create: bool = True) -> Path:
    """Before any rank starts: the run folder :func:`choose_run_dir` picks, created (``create``) or only
    checked that it could be. ConfigError (one sentence naming the folder) otherwise."""
    try:
        path = choose_run_dir(cfg, parallel)
    except OSError as err:
        raise _cannot(run_dir_base(cfg, parallel), err) from None
    return prepare_folder(path, create)


def prepare_folder(path: Path, create: bool = True) -> Path:
    """``path`` created (``create``), or checked without writing anything that it could be: it is a folder
    already, or its nearest existing parent is a writable folder. ConfigError otherwise."""
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _cannot(path, err) from None
        return path
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise _cannot(path, f"{parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _cannot(path, f"{parent} is not writable")
    return path


def resolve_run_dir(cfg, topology: Topology, device: torch.device) -> Path:
    """Rank 0 picks and creates the folder; the choice is broadcast so every rank uses the same one.
    A folder rank 0 cannot create is the same ConfigError on every rank (none goes on alone)."""
    base = run_dir_base(cfg, topology.config)
    world = topology.group("world")
    suffix = torch.zeros((), dtype=torch.int64, device=device)
    failure: OSError | None = None
    if world.rank == 0:
        try:
            chosen = choose_run_dir(cfg, topology.config)
            chosen.mkdir(parents=True, exist_ok=True)
            suffix.fill_(0 if chosen == base else int(chosen.name.rsplit("-", 1)[1]))
        except OSError as err:
            failure = err
            suffix.fill_(-1)
    comm.broadcast(suffix, world, src=0)
    n = int(suffix)
    if n < 0:
        raise _cannot(base, failure or "rank 0 could not create it")
    return base if n == 0 else base.with_name(f"{base.name}-{n}")
