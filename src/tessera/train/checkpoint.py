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
    partial = path.with_name(path.name + ".partial")
    if world.rank == 0 and partial.exists():
        shutil.rmtree(partial)
    comm.barrier(world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial), no_dist=world.size == 1)
    if world.rank == 0:
        (partial / "trainer.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if path.exists():
            shutil.rmtree(path)
        partial.rename(path)
    comm.barrier(world)
    return path


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
