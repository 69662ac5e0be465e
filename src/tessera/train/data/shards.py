"""Token shards on disk: written whole or not at all, read back as one stream per split.

A split (``train`` or ``val``) is a sequence of shards ``<split>-<k:05d>``:

    <split>-00000.bin   tokens, little-endian uint16 or uint32; each document followed by eot
    <split>-00000.idx   little-endian uint64 offsets [n_docs + 1]: document i is tokens [off[i], off[i+1])
                        (its eot included); off[0] = 0, off[-1] = the shard's token count
    <split>-00000.prompt  (supervised fine-tuning only) little-endian uint32 [n_docs]: how many of each
                        document's first tokens are its prompt (:mod:`tessera.train.data.sft`)

A shard holds whole documents and is closed once it holds at least ``shard_tokens`` tokens. Both files are
written under temporary names and renamed, ``.idx`` last: a shard is finished exactly when its ``.idx``
exists, which is what a resumed ``tessera prepare`` counts on.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import numpy as np

OFFSET_DTYPE = np.dtype("<u8")
PROMPT_DTYPE = np.dtype("<u4")
SHARD_FILES = (".bin", ".prompt", ".idx")  # in the order they are written


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}"


def _write_atomic(path: str, data: np.ndarray) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "wb") as f:
        f.write(np.ascontiguousarray(data).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Appends documents of one split to shards, starting at shard ``first_index`` (a resumed run).
    With ``prompts`` every document comes with its prompt length and each shard gets a ``.prompt`` file."""

    def __init__(self, out_dir: str, split: str, dtype: np.dtype, shard_tokens: int, first_index: int = 0,
                 prompts: bool = False):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, int(shard_tokens)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.index = first_index
        self.prompts = prompts
        self._parts: List[np.ndarray] = []
        self._offsets: List[int] = [0]
        self._prompt_lengths: List[int] = []

    def add(self, ids: np.ndarray, eot: int, prompt_tokens: Optional[int] = None) -> None:
        """Append one document (its ids, then ``eot``), of which the first ``prompt_tokens`` are its prompt
        (given exactly when the writer keeps prompts); closes the shard when it is full."""
        if (prompt_tokens is not None) != self.prompts:
            raise ValueError("a prompt length goes with every document of a writer that keeps prompts, only")
        doc = np.empty(len(ids) + 1, dtype=self.dtype)
        doc[:-1] = ids
        doc[-1] = eot
        self._parts.append(doc)
        self._offsets.append(self._offsets[-1] + len(doc))
        if prompt_tokens is not None:
            self._prompt_lengths.append(int(prompt_tokens))
        if self._offsets[-1] >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the open shard (if it holds anything) and start the next one."""
        if len(self._offsets) == 1:
            return
        base = os.path.join(self.out_dir, shard_name(self.split, self.index))
        _write_atomic(base + ".bin", np.concatenate(self._parts))
        if self.prompts:
            _write_atomic(base + ".prompt", np.asarray(self._prompt_lengths, dtype=PROMPT_DTYPE))
        _write_atomic(base + ".idx", np.asarray(self._offsets, dtype=OFFSET_DTYPE))
        self.index += 1
        self._parts, self._offsets, self._prompt_lengths = [], [0], []


def finished_shards(out_dir: str, split: str, dtype: np.dtype, prompts: bool = False) -> List[Dict[str, int]]:
    """``{"index", "tokens", "documents"}`` of the split's finished shards 0, 1, … (stops at the first gap
    or at a shard whose ``.bin`` (or, with ``prompts``, ``.prompt``) does not match its ``.idx``)."""
    found, index = [], 0
    while True:
        base = os.path.join(out_dir, shard_name(split, index))
        if not (os.path.isfile(base + ".idx") and os.path.isfile(base + ".bin")):
            return found
        offsets = np.fromfile(base + ".idx", dtype=OFFSET_DTYPE)
        if len(offsets) < 2 or os.path.getsize(base + ".bin") != int(offsets[-1]) * np.dtype(dtype).itemsize:
            return found
        if prompts and not (os.path.isfile(base + ".prompt") and os.path.getsize(base + ".prompt")
                            == (len(offsets) - 1) * PROMPT_DTYPE.itemsize):
            return found
        found.append({"index": index, "tokens": int(offsets[-1]), "documents": len(offsets) - 1})
        index += 1


def remove_shards_from(out_dir: str, keep: Dict[str, int]) -> None:
    """Delete temp files and every shard file of a split at or past ``keep[split]`` (its finished count)."""
    for name in os.listdir(out_dir):
        stem, ext = os.path.splitext(name)
        split, _, number = stem.partition("-")
        stray = name.startswith(".") and name.endswith(".tmp")
        ours = ext in SHARD_FILES and split in keep and number.isdigit()
        if stray or (ours and int(number) >= keep[split]):
            os.unlink(os.path.join(out_dir, name))


class TokenStream:
    """The shards of one split read as one stream: ``len()``, and indexing by an int, a slice or an integer
    array (of any shape) as a numpy array would, through read-only memory maps."""

    def __init__(self, paths: List[str], dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._maps = [np.memmap(p, dtype=self.dtype, mode="r") for p in paths]
        sizes = [len(m) for m in self._maps]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [n_shards + 1]
        self.doc_offsets: Optional[np.ndarray] = None  # [n_docs + 1] when known (:func:`document_offsets`)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self[np.arange(*key.indices(len(self)), dtype=np.int64)]
        idx = np.asarray(key, dtype=np.int64)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"token index out of range for a stream of {len(self)} tokens")
        idx = np.where(idx < 0, idx + len(self), idx)
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        out = np.empty(idx.shape, dtype=self.dtype)
        for s in np.unique(shard):  # one gather per shard touched
            sel = shard == s
            out[sel] = self._maps[s][idx[sel] - self._starts[s]]
        return out[()] if out.ndim == 0 else out

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate(self._maps) if self._maps else np.empty(0, self.dtype)
        return whole if dtype is None else whole.astype(dtype)


def open_split(out_dir: str, shards: List[Dict[str, int]], split: str, dtype: np.dtype) -> TokenStream:
    return TokenStream([os.path.join(out_dir, shard_name(split, s["index"]) + ".bin") for s in shards], dtype)


def document_offsets(out_dir: str, shards: List[Dict[str, int]], split: str) -> np.ndarray:
    """Start offsets in the split's stream of every document, plus the stream's end: uint64 [n_docs + 1]."""
    parts, base = [np.zeros(1, OFFSET_DTYPE)], 0
    for s in shards:
        offsets = np.fromfile(os.path.join(out_dir, shard_name(split, s["index"]) + ".idx"), OFFSET_DTYPE)
        parts.append(offsets[1:] + base)
        base += int(offsets[-1])
    return np.concatenate(parts)



def prompt_lengths(out_dir: str, shards: List[Dict[str, int]], split: str) -> np.ndarray:
    """Every document's prompt length in the split (supervised fine-tuning shards): uint32 [n_docs]."""
    parts = [np.fromfile(os.path.join(out_dir, shard_name(split, s["index"]) + ".prompt"), PROMPT_DTYPE)
             for s in shards]
    return np.concatenate(parts) if parts else np.empty(0, PROMPT_DTYPE)
