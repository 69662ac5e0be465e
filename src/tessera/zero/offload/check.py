"""What a launch checks for ``zero.offload = "disk"`` before any rank starts: the folder can be made and
written, and its disk has room for the state of this machine's ranks (one sentence, exit code 2,
otherwise)."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from tessera.errors import ConfigError
from tessera.zero.config import OffloadMode
from tessera.zero.offload.files import stale_folders

STATE_BYTES_PER_ELEMENT = 12  # fp32 master + AdamW's exp_avg + exp_avg_sq


def bytes_per_element(optim) -> int:
    """File bytes per master element for OptimConfig ``optim``: the fp32 master and the optimizer's [n] state
    (Adam/AdamW: two moments; SGD: the momentum buffer when momentum > 0; Adagrad: the sum)."""
    if optim.name == "sgd":
        return 8 if optim.momentum else 4
    return 8 if optim.name == "adagrad" else STATE_BYTES_PER_ELEMENT


def check_disk_offload(cfg, parallel, world: int) -> None:
    """``cfg`` a JobConfig, ``parallel`` its resolved degrees. For disk offload, ``zero.offload_dir`` ("":
    ``<run.out_dir>/offload``, see :func:`offload_folder`) must be a folder, or creatable in a writable one, on a
    disk whose free space (plus what killed runs left there) holds the masters and optimizer state of the ranks
    on this machine (:func:`state_bytes`). Nothing is written."""
    if OffloadMode(cfg.zero.offload) != "disk":
        return
    folder = offload_folder(cfg)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"zero.offload_dir: {folder} cannot be created ({existing} is not a folder); "
                          f"choose another zero.offload_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"zero.offload_dir: {folder} cannot be written ({existing} is not writable); "
                          f"choose another zero.offload_dir")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # under torchrun: this machine's ranks
    need = state_bytes(cfg, parallel) * local / world
    free = shutil.disk_usage(existing).free + (_stale_bytes(folder) if folder.is_dir() else 0)
    if need > free:
        raise ConfigError(f"zero.offload_dir: the offloaded state of this machine's {local} rank(s) needs "
                          f"{need / 1e9:.2f} GB but the disk of {folder} has {free / 1e9:.2f} GB free; free "
                          f"space or choose another zero.offload_dir")


def offload_folder(cfg) -> Path:
    """The folder of a job's offload files: ``zero.offload_dir``, or ``<run.out_dir>/offload`` when empty."""
    return Path(cfg.zero.offload_dir or Path(cfg.run.out_dir) / "offload")


def with_offload_folder(zero, cfg):
    """``zero`` (a ZeroConfig) with the job's offload folder filled in, for the engines (the config the
    user wrote, and saved with the run, keeps its empty default)."""
    return replace(zero, offload_dir=str(offload_folder(cfg))) if OffloadMode(zero.offload) == "disk" else zero


def state_bytes(cfg, parallel) -> float:
    """Bytes of fp32 masters and optimizer state the whole job holds (AdamW: 12 per trainable parameter), once
    per replica of the sharded state (``dp_replicate`` with hybrid sharding, else one)."""
    replicas = parallel.dp_replicate if parallel.dp_shard > 1 else 1
    return bytes_per_element(cfg.optim) * cfg.model.num_params(moe=cfg.moe) * replicas


def _stale_bytes(folder: Path) -> int:
    """Bytes held by sub-folders of ``folder`` that killed runs left (an engine deletes them at start)."""
    total = 0
    for sub, lock in stale_folders(folder):
        total += sum(f.stat().st_blocks * 512 for f in sub.glob("*.bin"))
        os.close(lock)
    return total
