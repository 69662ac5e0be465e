"""Save and load :class:`~tessera.checkpoint.pieces.Piece` s through torch.distributed.checkpoint (DCP).

A checkpoint is a folder::

    step_000050/
        .metadata        DCP: every tensor's global shape, dtype and saved chunks (offsets, sizes)
        __<r>_0.distcp   DCP: the chunks rank r wrote (replicated pieces written once)
        trainer.json     the caller's ``meta`` (JSON: step, data position, config …; never tensors)
        manifest.json    every file above with its byte size and sha256, written last

Files hold single-process names, global shapes and offsets only, so a checkpoint written under one
layout (tp2×pp2, ZeRO-3 over 4 ranks …) loads under any other (dp4, tp4, one process): each rank asks for
its own pieces and DCP reads the overlapping parts of whatever chunks were saved.

Atomic: a save writes into ``<path>.partial/`` and rank 0 renames it to ``path`` once every file and the
manifest are on disk, replacing an older checkpoint at ``path`` only then; a run killed mid-save leaves
the previous checkpoint intact and a stale ``.partial`` that the next save removes.

Checked: each rank checksums the data files it wrote; rank 0 gathers the sums into the manifest. A load
verifies the manifest first (each rank hashes a share of the files), reads ``.metadata``
with a restricted unpickler and tensor data with ``torch.load(weights_only=True)`` (see
:mod:`~tessera.checkpoint.safe_reader`). Every problem a user can cause — a missing folder or file, a
damaged file, a checkpoint of another model — is one :class:`CheckpointError` sentence naming the file or
tensor, raised on every rank alike (ranks agree on the first error before going on, so none hangs).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tessera import comm
from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.manifest import (
    MANIFEST,
    describe,
    read_manifest,
    verify_files,
    write_json,
    write_manifest,
)
from tessera.checkpoint.pieces import Piece
from tessera.checkpoint.planners import PieceLoadPlanner, PieceSavePlanner, covered
from tessera.checkpoint.safe_reader import METADATA_FILE, SafeFileSystemReader, read_dcp_metadata
from tessera.comm.collectives import comm_failure
from tessera.comm.group import CommGroup
from tessera.errors import CommTimeoutError, PeerGoneError

META = "trainer.json"
_STEP = re.compile(r"step_(\d+)")
_MESSAGE_BYTES = 4096  # an agreed error travels between ranks as this many utf-8 bytes


@contextlib.contextmanager
def _quiet():
    """DCP warns that it 'assumes' a single process when told so with no_dist, and about overwriting."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        yield


@contextlib.contextmanager
def _dcp_errors(action: str, path: Path, world: CommGroup):
    """DCP reports any rank's failure on every rank as a ``CheckpointException``, a BaseException that
    ``except Exception`` misses: an OSError (disk full, permission) becomes a CheckpointError sentence,
    anything else a RuntimeError carrying DCP's per-rank tracebacks. A collective of DCP's own planning
    that fails (a peer killed while the ranks save) raises the backend's RuntimeError instead: it becomes
    the one-sentence communication error every other collective gives (``tessera.comm``) when the backend
    says a peer is gone or hung; any other RuntimeError is DCP's own and passes unchanged."""
    try:
        yield
    except RuntimeError as err:
        failure = comm_failure(world, f"checkpoint {action} (DCP's planning collectives)", world.seq + 1, err)
        if not isinstance(failure, (PeerGoneError, CommTimeoutError)):
            raise  # not a lost or hung peer: DCP's own error, as it was
        world.next_seq()
        raise failure from err
    except CheckpointException as err:
        first = next(iter(err.failures.values()), (None, None))[0]
        if isinstance(first, CheckpointError):
            raise first from None
        if isinstance(first, OSError):
            raise CheckpointError(f"{action} checkpoint {path} failed: {first}") from None
        raise RuntimeError(str(err)) from first


# ---- save ---------------------------------------------------------------------------------------
def save_pieces(path: Path, pieces: list[Piece], meta: dict, world: CommGroup) -> Path:
    """Collective over ``world``: write every rank's pieces and ``meta`` as the checkpoint ``path``.

    Pieces with the same name and offsets on several ranks are written once; a rank may hold several
    pieces of one tensor. Together the ranks must cover each tensor whole. Returns ``path``.
    """
    path = Path(path)
    meta_text = json.dumps(meta)  # every rank: a meta that is not JSON fails everywhere, before any write
    partial = path.with_name(path.name + ".partial")
    # each step that can fail on some ranks only ends in _agree (not a barrier): all raise, none hangs
    _agree(world, _attempt(lambda: _clear(partial) if world.rank == 0 else None, path))
    with _quiet(), _dcp_errors("saving", path, world):
        dcp.save({}, storage_writer=FileSystemWriter(str(partial)), planner=PieceSavePlanner(pieces),
                 process_group=world.pg, no_dist=world.size == 1)
    _agree(world, _attempt(lambda: _hash_own_files(partial, world), path))
    _agree(world, _attempt(functools.partial(_commit, partial, path, meta_text), path) if world.rank == 0 else None)
    return path


def _clear(partial: Path) -> None:
    if partial.exists():
        shutil.rmtree(partial)  # left by a save that was killed


def _hash_own_files(partial: Path, world: CommGroup) -> None:
    """Each rank checksums the data files it wrote (DCP names them ``__<rank>_<i>.distcp``) into a
    ``.sums_<rank>.json`` beside them, so the hashing is spread over the ranks; rank 0 merges them."""
    if world.size > 1:
        own = sorted(partial.glob(f"__{world.rank}_*.distcp"))
        write_json(partial / f".sums_{world.rank}.json", {p.name: describe(p) for p in own})


def _commit(partial: Path, path: Path, meta_text: str) -> None:
    """Rank 0, once every rank's files are on disk: add ``trainer.json`` and the manifest, then rename."""
    write_json(partial / META, json.loads(meta_text))
    write_manifest(partial, _gather_sums(partial))
    _replace(partial, path)


def _gather_sums(partial: Path) -> dict[str, dict]:
    """The entries every rank computed (files they do not name are hashed by rank 0); the fragments go."""
    known: dict[str, dict] = {}
    for fragment in sorted(partial.glob(".sums_*.json")):
        known.update(json.loads(fragment.read_text(encoding="utf-8")))
        fragment.unlink()
    return known


def _replace(partial: Path, path: Path) -> None:
    """Rename the finished ``partial`` to ``path``; an older ``path`` is moved aside to ``.old`` first
    and deleted only after the rename, so a complete checkpoint is on disk at every instant (for the
    instant between the two renames, as ``.old`` and ``.partial``; :func:`latest` skips both)."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        path.rename(old)
    partial.rename(path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- load ---------------------------------------------------------------------------------------
def load_pieces(path: Path, pieces: list[Piece], world: CommGroup) -> dict:
    """Collective over ``world``: fill every rank's pieces in place from the checkpoint ``path``,
    whatever layout wrote it; returns its ``meta`` (``trainer.json``).

    Raises :class:`CheckpointError` on every rank for a missing folder or file, a file whose size or
    checksum differs from the manifest, or a piece whose tensor the checkpoint lacks or holds with
    another global shape; nothing is read into any piece then. Values are cast to each piece's dtype and
    device (a bf16 checkpoint loads into fp32 pieces and back).
    """
    path = Path(path)
    _agree(world, _attempt(lambda: _verify_share(path, world)))
    found: dict = {}
    _agree(world, _attempt(lambda: found.update(metadata=_check_pieces(path, pieces), meta=read_meta(path))))
    with _quiet(), _dcp_errors("loading", path, world):
        dcp.load({}, storage_reader=SafeFileSystemReader(path, found["metadata"]),
                 planner=PieceLoadPlanner(pieces), process_group=world.pg, no_dist=world.size == 1)
    return found["meta"]


def verify(path: Path, pieces: list[Piece]) -> None:
    """One process, nothing loaded: every file of checkpoint ``path`` against its manifest (sizes and
    checksums), and every piece's tensor present with its global shape; raises CheckpointError. What a
    launcher checks before any rank starts (a load checks the same again, shared among its ranks)."""
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest, sorted(set(manifest["files"]) | {METADATA_FILE, META}))
    _check_pieces(path, pieces)


def _verify_share(path: Path, world: CommGroup) -> None:
    """Check this rank's share of the files (every ``world.size``-th, in name order) against the manifest."""
    manifest = read_manifest(path)
    names = sorted(set(manifest["files"]) | {METADATA_FILE, META})  # these two must be listed
    verify_files(path, manifest, names[world.rank::world.size])


def _check_pieces(path: Path, pieces: list[Piece]) -> Metadata:
    """The checkpoint's DCP metadata, after checking it holds each piece's tensor, shape and region."""
    metadata = read_dcp_metadata(path)
    source = path / METADATA_FILE
    for p in pieces:
        saved = metadata.state_dict_metadata.get(p.name)
        # optimizer state ("optim/<param>/<key>") that differs means another optimizer or none was saved
        state = p.name.startswith("optim/")
        if not isinstance(saved, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {source} holds no optimizer state {p.name}, which this job's optimizer needs: it "
                f"was saved without optimizer state or by another optimizer" if state else
                f"checkpoint {source} holds no tensor {p.name}: it was saved from another model or configuration")
        if tuple(saved.size) != tuple(p.global_shape):
            whose = "this job's optimizer state" if state else "this model"
            raise CheckpointError(f"checkpoint {source} holds {p.name} of shape {list(saved.size)} but {whose} "
                                  f"needs {list(p.global_shape)}: it was saved from another model or optimizer")
        if not covered(p, saved):
            raise CheckpointError(f"checkpoint {source} holds only part of {p.name} (rows/columns from offsets "
                                  f"{list(p.offsets)} are missing): it was saved incompletely")
    return metadata


def _attempt(fn, saving: Path | None = None) -> CheckpointError | None:
    """Run ``fn``; return the CheckpointError it raised (an OSError too while ``saving``), else None."""
    try:
        fn()
    except CheckpointError as err:
        return err
    except OSError as err:
        if saving is None:
            raise
        return CheckpointError(f"saving checkpoint {saving} failed: {err}; the previous checkpoint is intact")
    return None


def _agree(world: CommGroup, err: CheckpointError | None) -> None:
    """Every rank raises the error of the lowest failing rank, or none raises: no rank goes on into a
    collective that a failed rank skips."""
    if world.size == 1:
        if err is not None:
            raise err
        return
    device = world.device  # where the world group's collectives take their tensors
    first = torch.tensor([world.rank if err is not None else world.size], dtype=torch.int64, device=device)
    comm.all_reduce(first, world, op="min")
    src = int(first.item())
    if src == world.size:
        return
    buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if world.rank == src:
        raw = (str(err) or "checkpoint error").encode("utf-8")[:_MESSAGE_BYTES]
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    comm.broadcast(buf, world, src=src)
    if err is not None and world.rank == src:
        raise err
    message = bytes(buf.cpu().tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
    raise CheckpointError(message)


# ---- what a checkpoint holds --------------------------------------------------------------------
def checkpoint_tensors(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint ``path`` holds: name -> global shape (single process; checks the
    metadata file against the manifest, not the data files)."""
    path = Path(path)
    verify_files(path, read_manifest(path), [METADATA_FILE])
    metadata = read_dcp_metadata(path)
    return {name: tuple(md.size) for name, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def read_meta(path: Path) -> dict:
    """The ``meta`` given to :func:`save_pieces` (``trainer.json``)."""
    file = Path(path) / META
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {file} is missing: {Path(path)} is incomplete") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {err}") from None


# ---- a folder of periodic checkpoints -----------------------------------------------------------
def step_path(folder: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes: ``<folder>/step_000050``."""
    return Path(folder) / f"step_{step:06d}"


def is_complete(path: Path) -> bool:
    """A finished checkpoint folder (``trainer.json`` and the manifest written last are present)."""
    return (path / META).is_file() and (path / MANIFEST).is_file()


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """The complete ``step_<n>`` checkpoints in ``folder``, oldest first (``.partial`` / ``.old`` ignored)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir()]
    return sorted((s, p) for s, p in found if is_complete(p))


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint in ``folder`` (the one to resume from), or None."""
    found = checkpoints(folder)
    return found[-1][1] if found else None


def resolve(path: Path) -> Path | None:
    """``path`` itself when it is a complete checkpoint, else the newest complete one inside it, or None."""
    path = Path(path)
    return path if is_complete(path) else latest(path)


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (``keep <= 0``: keep all), and leftovers
    (``.partial`` / ``.old``) of saves older than the newest; returns what was deleted. Single process:
    rank 0 calls it after a save, while no save is running."""
    found = checkpoints(folder)
    doomed = [p for _, p in found[:-keep]] if keep > 0 else []
    if found:
        newest = found[-1][0]
        for p in Path(folder).iterdir():
            stem, _, suffix = p.name.rpartition(".")
            if suffix in ("partial", "old") and (m := _STEP.fullmatch(stem)) and int(m.group(1)) <= newest:
                doomed.append(p)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
