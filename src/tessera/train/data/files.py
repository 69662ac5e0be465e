"""Files that are written whole or not at all, and the lock that makes processes building the same
token cache take turns."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Callable, Dict, Iterator, Optional, Tuple

from tessera.errors import ConfigError

try:  # POSIX only; without it concurrent builders still never see a torn cache (os.replace).
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def temp_writer(out_dir: str, final_name: str) -> Iterator:
    """Write to a temp file in out_dir, then atomically rename it to final_name;
    a crash leaves at worst a stray temp file, never a half-written final file."""
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{final_name}.", suffix=".tmp")
    os.fchmod(fd, 0o644)  # mkstemp makes 0600; a shared cache must stay readable
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(out_dir, final_name))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(out_dir: str, name: str, value: Dict[str, object]) -> None:
    with temp_writer(out_dir, name) as f:
        f.write(json.dumps(value, indent=2, sort_keys=True).encode("utf-8"))


def read_json(out_dir: str, name: str) -> Optional[Dict[str, object]]:
    path = os.path.join(out_dir, name)
    if not os.path.exists(path):
        return None
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


@contextlib.contextmanager
def exclusive(lock_path: str) -> Iterator[None]:
    """Hold an exclusive lock so processes building the same cache take turns."""
    with open(lock_path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def built_once(out_dir: str, what: str, build: Callable[[], Dict[str, object]]) -> Tuple[Dict[str, object], bool]:
    """(the meta.json of ``out_dir``, whether this call built it). ``meta.json`` is written last, so it marks a
    complete folder: read without a lock when present; else the folder is created (``what`` names it in the
    error) and, under its lock, read again (another process may have finished it while we waited) or made by
    ``build`` (which writes meta.json and returns it)."""
    meta = read_json(out_dir, "meta.json")  # fast path: no lock once the folder is complete
    if meta is not None:
        return meta, False
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what} {out_dir!r} cannot be created ({e.strerror})") from e
    with exclusive(os.path.join(out_dir, ".lock")):
        meta = read_json(out_dir, "meta.json")
        return (meta, False) if meta is not None else (build(), True)
