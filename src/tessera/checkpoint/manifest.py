"""``manifest.json``: every file of a checkpoint with its size and sha256, written last before the folder
is renamed into place, checked before anything is read, so a truncated or flipped file is named in a
sentence instead of surfacing as a pickle or shape error deep inside a load."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tessera.checkpoint.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "tessera-checkpoint"
_BLOCK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, value) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file, fsynced, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def describe(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def write_manifest(folder: Path, known: dict[str, dict] | None = None) -> dict:
    """List every file under ``folder`` (but the manifest) with its byte size and sha256; ``known`` holds
    entries other ranks already computed for the files they wrote (hashing spread over the ranks)."""
    files, known = {}, known or {}
    for p in sorted(folder.rglob("*")):
        name = p.relative_to(folder).as_posix()
        if p.is_file() and name != MANIFEST:
            files[name] = known[name] if name in known else describe(p)
    manifest = {"format": FORMAT, "version": 1, "files": files}
    write_json(folder / MANIFEST, manifest)
    return manifest


def read_manifest(folder: Path) -> dict:
    """The manifest of the checkpoint in ``folder``; CheckpointError if the folder or manifest is missing
    or unreadable."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing: {folder} is incomplete or not a checkpoint "
                              f"written by tessera") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(
            manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint file {path} is not a tessera checkpoint manifest")
    return manifest


def verify_files(folder: Path, manifest: dict, names: list[str]) -> None:
    """Check that each of ``names`` exists with the size and sha256 the manifest records."""
    for name in names:
        entry, path = manifest["files"].get(name), folder / name
        if entry is None:
            raise CheckpointError(f"checkpoint file {folder / MANIFEST} lists no {name}: {folder} is incomplete")
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes but was written with "
                                  f"{entry['bytes']}: it is truncated or damaged")
        if sha256(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {path} does not match its checksum in {MANIFEST}: "
                                  f"it is damaged")
