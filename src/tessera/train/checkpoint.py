"""The trainer's checkpoints: this rank's model and optimizer state as layout-independent pieces.

Thin glue between the trainer and :mod:`tessera.checkpoint`: :func:`tessera.checkpoint.state_pieces`
says which parts of which single-process tensors this rank holds (under any layout the trainer builds),
:func:`tessera.checkpoint.save_pieces` / :func:`~tessera.checkpoint.load_pieces` write and read them
through torch.distributed.checkpoint, atomically, with resharding on load. ``meta`` (JSON) is the
trainer's own position: step, data sampler, loss scale, random generators.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from tessera.checkpoint import finish_load, load_pieces, save_pieces, state_pieces
from tessera.comm.group import CommGroup


def save_training_state(path: Path, meta: dict, core: nn.Module, optimizer, engine, topology) -> Path:
    """Collective over the world: every rank writes its pieces into checkpoint ``path``."""
    pieces = state_pieces(core, optimizer, topology, engine)
    saved = save_pieces(path, pieces, meta, topology.group("world"))
    settle = getattr(optimizer, "settle", None)  # disk offload: the save read the state files; unmap them
    if settle is not None:
        settle()
    return saved


def load_training_state(path: Path, core: nn.Module, optimizer, engine, topology) -> dict:
    """Collective over the world: fill this rank's model and optimizer state from ``path`` (whatever
    layout wrote it); returns the checkpoint's ``meta``. ``core`` is the model as this rank holds it
    (materialised slices, or ZeRO shards): each piece is a view of live storage and DCP reads only the
    parts of the saved tensors that overlap it, so no rank ever holds a whole model."""
    meta = load_pieces(path, state_pieces(core, optimizer, topology, engine), topology.group("world"))
    finish_load(core, optimizer, engine)
    return meta


def load_model(path: Path, model: nn.Module) -> dict:
    """One process: a checkpoint's weights (any layout) into a single-device ``model``; returns meta."""
    return load_pieces(path, state_pieces(model, None), CommGroup.single())
