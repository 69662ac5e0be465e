"""A checkpoint as one safetensors file: the plain single-process state_dict, whatever layout saved it.

Single process: every tensor under ``prefix`` is loaded whole (DCP with no process group assembles it
from all saved chunks) and written to one ``.safetensors`` file under its name without the prefix, so
``safetensors.torch.load_file(out)`` gives what ``model.state_dict()`` of a one-process run holds.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.pieces import Piece
from tessera.checkpoint.safe_reader import read_dcp_metadata
from tessera.checkpoint.store import META, load_pieces, read_meta, resolve
from tessera.comm.group import CommGroup


def consolidate(path: Path, prefix: str = "model/") -> tuple[dict[str, torch.Tensor], int | None]:
    """Every tensor of checkpoint ``path`` whose name starts with ``prefix``, whole, in this one process,
    under its name without the prefix; and the step it was saved at (None if unrecorded)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    saved = read_dcp_metadata(path).state_dict_metadata
    pieces = [Piece.whole(name, torch.empty(tuple(md.size), dtype=md.properties.dtype))
              for name, md in sorted(saved.items()) if name.startswith(prefix) and hasattr(md, "size")]
    if not pieces:
        raise CheckpointError(f"checkpoint {path} holds no tensor whose name starts with '{prefix}'")
    meta = load_pieces(path, pieces, CommGroup.single())
    step = meta.get("step") if isinstance(meta, dict) else None
    return {p.name[len(prefix):]: p.tensor for p in pieces}, step


def export_safetensors(path: Path, out: Path, prefix: str = "model/") -> Path:
    """Write every tensor of checkpoint ``path`` whose name starts with ``prefix`` to the safetensors file
    ``out`` (names without the prefix; written to ``<out>.tmp`` then renamed). Returns ``out``."""
    path, out = Path(path), Path(out)
    tensors, step = consolidate(path, prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "source": path.name,
                                           **({"step": str(step)} if step is not None else {})})
    os.replace(tmp, out)
    return out


def export_command(checkpoint: str | Path, out: str | Path | None = None) -> int:
    """``tessera export CHECKPOINT [OUT]``: the model weights of a checkpoint as one safetensors file
    (default ``<checkpoint>.safetensors`` beside the folder). CHECKPOINT may also be a folder of
    ``step_<n>`` checkpoints: the newest complete one is exported. Prints what it wrote; returns 0."""
    checkpoint = resolve(checkpoint) or Path(checkpoint)  # a folder of step_<n>: its newest
    target = Path(out) if out is not None else checkpoint.with_name(checkpoint.name + ".safetensors")
    written = export_safetensors(checkpoint, target)
    lora = read_meta(checkpoint).get("lora") if (checkpoint / META).is_file() else None
    what = ("the LoRA adapters (alone: --merge-lora writes the merged model)" if lora else "the model weights")
    print(f"wrote {written} ({written.stat().st_size / 1e6:.1f} MB), {what} of {checkpoint}")
    return 0
