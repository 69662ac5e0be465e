"""The one error a user can cause with a checkpoint: a missing, damaged or incompatible one."""

from __future__ import annotations

from tessera.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded (missing, corrupted, from another model, unsafe); one sentence
    that names the file or tensor. Raised on every rank of a collective load, never a hang."""
