"""Layout-independent checkpoints: pieces of single-process tensors saved and loaded through DCP."""

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.export import export_command, export_safetensors
from tessera.checkpoint.pieces import Piece
from tessera.checkpoint.store import (
    checkpoint_tensors,
    checkpoints,
    is_complete,
    latest,
    load_pieces,
    prune,
    read_meta,
    resolve,
    save_pieces,
    step_path,
    verify,
)
from tessera.checkpoint.state import ensure_optimizer_state, finish_load, state_pieces
