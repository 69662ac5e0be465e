"""Checkpoints of model and optimizer through torch.distributed.checkpoint (DCP).

DCP writes one file per rank plus a metadata file, keyed by parameter name, so replicated state is
written once and sharded state (later strategies) keeps its global shape. The trainer's own position
(step, data sampler) goes into ``trainer.json`` beside it. A save is written to ``<path>.partial`` and
renamed once complete, so a run killed mid-save never leaves a checkpoint that looks whole.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tessera import comm
from tessera.comm.group import CommGroup


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes' a single process even when told so with no_dist; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
                    world: CommGroup) -> Path:
    """Collective over ``world``: every rank writes its part; rank 0 writes ``trainer.json`` and renames."""
    partial = _begin(path, world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial), no_dist=world.size == 1)
    return _commit(partial, path, meta, world)


def _begin(path: Path, world: CommGroup) -> Path:
    """The ``.partial`` folder every rank writes into (emptied first), so a kill mid-save never touches
    the previous checkpoint at ``path``."""
    partial = path.with_name(path.name + ".partial")
    if world.rank == 0 and partial.exists():
        shutil.rmtree(partial)
    comm.barrier(world)
    return partial


def _commit(partial: Path, path: Path, meta: dict, world: CommGroup) -> Path:
    """Once every rank has written: rank 0 adds ``trainer.json`` and renames ``partial`` to ``path``."""
    comm.barrier(world)
    if world.rank == 0:
        (partial / "trainer.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if path.exists():
            shutil.rmtree(path)
        partial.rename(path)
    comm.barrier(world)
    return path


def save_sharded_checkpoint(path: Path, engine, model: nn.Module, meta: dict, world: CommGroup) -> Path:
    """A ZeRO engine's checkpoint (collective over ``world``): the full model weights through DCP (every
    rank holds or gathers them, DCP writes each once) and each rank's optimizer shard (fp32 masters and
    state) as ``optim/rank<r>.pt``, which reloads at the same layout."""
    partial = _begin(path, world)
    weights = engine.full_state() if hasattr(engine, "full_state") else {
        k: v.detach() for k, v in model.state_dict().items()}
    with _quiet_single_process():
        dcp.save({"model": weights}, checkpoint_id=str(partial), no_dist=world.size == 1)
    (partial / "optim").mkdir(parents=True, exist_ok=True)
    shards = {"optimizer": engine.optimizer.state_dict(),
              "masters": [s.master.detach().cpu() for s in engine.update.shards]}
    torch.save(shards, partial / "optim" / f"rank{world.rank}.pt")
    return _commit(partial, path, meta, world)


def load_sharded_checkpoint(path: Path, engine, rank: int) -> dict:
    """Restore a ZeRO engine from :func:`save_sharded_checkpoint` at the same layout (``rank`` = this
    rank in the world the checkpoint was written by): optimizer state and fp32 masters of this rank's
    slices, the compute-dtype slices from them, then the full parameters gathered again."""
    shards = torch.load(path / "optim" / f"rank{rank}.pt", map_location="cpu", weights_only=True)
    engine.optimizer.load_state_dict(shards["optimizer"])
    with torch.no_grad():
        for shard, master in zip(engine.update.shards, shards["masters"], strict=True):
            shard.master.copy_(master)
            if shard.param.data_ptr() != shard.master.data_ptr():
                shard.param.copy_(master)
    engine.gather_params()
    return json.loads((path / "trainer.json").read_text(encoding="utf-8"))


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load model (and optimizer) state saved by :func:`save_checkpoint`; returns ``trainer.json``."""
    model_sd, optim_sd = get_state_dict(model, optimizer) if optimizer is not None else (
        get_state_dict(model, [])[0], None)
    state = {"model": model_sd}
    if optim_sd is not None:
        state["optim"] = optim_sd
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}))
    return json.loads((path / "trainer.json").read_text(encoding="utf-8"))
