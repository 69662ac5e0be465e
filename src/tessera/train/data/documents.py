"""Documents out of input files, and the train/validation split of documents.

Formats: a text file is one document; a ``.jsonl`` file holds one JSON object per non-blank line, its
text under a field (``text`` by default); a ``.parquet`` file holds one document per row of a string
column, read in record batches (``pyarrow``, the ``data`` extra). Every document has a key, stable across
machines (``rel`` for a text file, ``rel#line`` / ``rel#row`` otherwise), which decides its split.

Listing keys is cheap (no JSON parsing, parquet row counts from the file footer), so the split's
fallbacks — at least one validation and one training document — are known before anything is tokenised.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Tuple

from tessera.errors import ConfigError

FORMATS = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}  # what a folder walk picks up


@dataclass(frozen=True)
class Source:
    """One input file: ``rel`` names it in document keys, ``kind`` is text, jsonl or parquet."""

    rel: str
    path: str
    kind: str
    size: int
    mtime_ns: int


def _source(rel: str, path: str, kind: str) -> Source:
    st = os.stat(path)
    return Source(rel, path, kind, st.st_size, st.st_mtime_ns)


def _kind(name: str) -> Optional[str]:
    return next((kind for ext, kind in FORMATS.items() if name.endswith(ext)), None)


def find_sources(inputs: Iterable[str]) -> List[Source]:
    """The files of ``tessera prepare``'s inputs, in the order given; a folder's .txt, .jsonl and .parquet
    files in sorted order (hidden folders skipped). A file named directly is text unless it is .jsonl or
    .parquet. ``rel`` is the path below the input's parent folder."""
    found: List[Source] = []
    for given in inputs:
        path = os.path.realpath(os.path.expanduser(given))
        base = os.path.dirname(path)
        if os.path.isfile(path):
            found.append(_source(os.path.basename(path), path, _kind(path) or "text"))
        elif os.path.isdir(path):
            inside = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for name in filenames:
                    full = os.path.join(dirpath, name)
                    if _kind(name) and os.path.isfile(full):
                        inside.append((os.path.relpath(full, base).replace(os.sep, "/"), full))
            found += [_source(rel, full, _kind(full) or "text") for rel, full in sorted(inside)]
        else:
            raise ConfigError(f"input {given!r} does not exist")
    if not found:
        raise ConfigError(f"the inputs hold no .txt, .jsonl or .parquet file: {' '.join(inputs)}")
    return found


def text_sources(files: Iterable[Tuple[str, str, int, int]]) -> List[Source]:
    """Sources of a training corpus's files ((rel, path, size, mtime_ns) each): every one is text."""
    return [Source(rel, path, "text", size, mtime) for rel, path, size, mtime in files]


# ---------------------------------------------------------------- reading


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading .parquet needs pyarrow: pip install 'tessera[data]'") from None
    return pq


def _parquet_file(src: Source, text_field: str):
    pq = _pyarrow_parquet()
    try:
        pf = pq.ParquetFile(src.path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise ConfigError(f"{src.path} is not a parquet file pyarrow can read ({e})") from e
    if text_field not in pf.schema_arrow.names:
        raise ConfigError(f"{src.path} has no column {text_field!r} (it has {', '.join(pf.schema_arrow.names)}); "
                          f"choose one with --text-field")
    return pf


def jsonl_lines(src: Source) -> Iterator[Tuple[int, bytes]]:
    """(1-based line number, line) of every non-blank line."""
    with open(src.path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def document_keys(src: Source, text_field: str) -> Iterator[str]:
    """The key of every document ``src`` may hold, without reading any text."""
    if src.kind == "text":
        yield src.rel
    elif src.kind == "jsonl":
        for number, _ in jsonl_lines(src):
            yield f"{src.rel}#{number}"
    else:
        for row in range(_parquet_file(src, text_field).metadata.num_rows):
            yield f"{src.rel}#{row}"


def read_text_bytes(path: str) -> Optional[bytes]:
    """The file's bytes if it is non-empty UTF-8 text without NUL, else None (skipped)."""
    with open(path, "rb") as f:
        data = f.read()
    if not data or b"\0" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def _read_text_file(path: str) -> Optional[str]:
    data = read_text_bytes(path)
    return None if data is None else data.decode("utf-8")


def _usable(text: object) -> Optional[str]:
    return text if isinstance(text, str) and text and "\0" not in text else None


def _jsonl_text(src: Source, number: int, line: bytes, text_field: str) -> Optional[str]:
    try:
        record = json.loads(line)
    except ValueError:
        raise ConfigError(f"{src.path} line {number} is not valid JSON") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), (str, type(None))):
        raise ConfigError(f"{src.path} line {number} is not a JSON object whose {text_field!r} is a string; "
                          f"choose the field with --text-field")
    return _usable(record.get(text_field))


def documents(src: Source, text_field: str) -> Iterator[Tuple[str, Optional[str]]]:
    """(key, text) of every key :func:`document_keys` lists, in the same order; text None for a document
    that is skipped (empty, null, not UTF-8, or holding NUL)."""
    if src.kind == "text":
        yield src.rel, _read_text_file(src.path)
    elif src.kind == "jsonl":
        for number, line in jsonl_lines(src):
            yield f"{src.rel}#{number}", _jsonl_text(src, number, line, text_field)
    else:
        pf, row = _parquet_file(src, text_field), 0
        for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is not None and not isinstance(text, str):
                    raise ConfigError(f"{src.path} column {text_field!r} holds {type(text).__name__}, not text")
                yield f"{src.rel}#{row}", _usable(text)
                row += 1


# ---------------------------------------------------------------- splitting


def hash_fraction(key: str) -> float:
    """A stable number in [0, 1) per key; Python's hash() is salted per process."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class SplitRule:
    """Which documents are held out: those whose key hashes below ``val_fraction``; if none does, the
    lowest-hashing one; if all do, the highest-hashing one goes back to training. So validation text is
    never trained on, and with two documents or more both splits get one."""

    def __init__(self, keys: Iterable[str], val_fraction: float) -> None:
        self.val_fraction = float(val_fraction)
        lowest = highest = None
        self.n_keys = n_val = 0
        for key in keys:
            frac = hash_fraction(key)
            self.n_keys += 1
            n_val += frac < self.val_fraction
            if lowest is None or frac < lowest[0]:
                lowest = (frac, key)
            if highest is None or frac > highest[0]:
                highest = (frac, key)
        self.forced_val = lowest[1] if n_val == 0 and lowest else None
        all_val = n_val + (self.forced_val is not None) == self.n_keys
        self.forced_train = highest[1] if all_val and highest else None

    def is_val(self, key: str) -> bool:
        if key == self.forced_train:
            return False
        return key == self.forced_val or hash_fraction(key) < self.val_fraction
