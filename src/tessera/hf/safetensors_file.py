"""Tensors of safetensors files as sources of initial values, read a chunk at a time.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative to
the end of the header) and then the tensors' bytes, row-major, little-endian. So element i of a tensor
sits at a known byte offset, and :meth:`FileTensor.chunk` reads elements [k·CHUNK, (k+1)·CHUNK) through a
memory map of the file without touching the rest of it: a :class:`FileTensor` is a source for
``tessera.models.init.Origin`` like a drawn ``InitSpec``, so every tp slice, pipeline stage, ZeRO-3 flat
shard and expert of any layout is filled from the file directly, a chunk at a time, and no rank reads a
whole tensor it does not hold. Only the headers are read to list a folder's tensors.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.errors import ConfigError, UserError
from tessera.models import init as init_values

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_MAX_HEADER = 100 << 20  # bytes: safetensors' own limit on the JSON header


@dataclass(frozen=True)
class FileTensor:
    """Tensor ``key`` of safetensors file ``path``: ``shape``, stored as ``dtype`` (a safetensors dtype
    name) from byte ``start`` of the file on. Its chunks are fp32 on the CPU, whatever it is stored in."""

    path: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def constant(self) -> float | None:
        return None  # every element is read

    def chunk(self, k: int) -> torch.Tensor:
        """Elements [k·CHUNK, (k+1)·CHUNK) of the flattened tensor, fp32 [n] on the CPU; reads those bytes only."""
        size = init_values.CHUNK
        n = min(size, self.numel - k * size)
        dtype = DTYPES[self.dtype]
        offset = self.start + k * size * dtype.itemsize
        # ACCESS_COPY: a private, writable mapping (torch wants writable buffers); reading copies no page
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
            stored = torch.frombuffer(mapped, dtype=dtype, count=n, offset=offset)
            out = stored.to(torch.float32, copy=True)
            del stored  # the map can close only once no tensor views it
        return out


def read_header(file: Path) -> dict[str, FileTensor]:
    """The tensors of safetensors ``file`` by name, from its header alone; UserError if it is not one."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError("header too long")
            header = json.loads(f.read(length))
        size = file.stat().st_size
    except (OSError, ValueError, struct.error) as err:
        raise UserError(f"{file} is not a readable safetensors file ({err}).") from None
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        tensors[key] = _file_tensor(file, key, entry, 8 + length, size)
    return tensors


def _file_tensor(file: Path, key: str, entry: dict, data_start: int, size: int) -> FileTensor:
    """The FileTensor of header ``entry``; ConfigError for a dtype tessera does not read, UserError for
    offsets that do not fit the shape or the file."""
    if entry.get("dtype") not in DTYPES:
        raise ConfigError(f"Tensor {key!r} of {file.name} is stored as {entry.get('dtype')}; tessera reads "
                          f"{', '.join(DTYPES)} weights.")
    shape = tuple(int(d) for d in entry["shape"])
    begin, end = (int(o) for o in entry["data_offsets"])
    if end - begin != math.prod(shape) * DTYPES[entry["dtype"]].itemsize or data_start + end > size:
        raise UserError(f"Tensor {key!r} of {file} has data offsets {begin}..{end} that do not fit its "
                        f"shape {shape} or the file; the file is damaged.")
    return FileTensor(str(file), key, shape, entry["dtype"], data_start + begin)


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder: one ``model.safetensors`` or those a sharded index lists."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    raise UserError(f"{folder} holds neither model.safetensors nor model.safetensors.index.json.")


def folder_tensors(folder: Path) -> dict[str, FileTensor]:
    """Every tensor of an HF folder's safetensors files by its HF name (headers only)."""
    tensors: dict[str, FileTensor] = {}
    for file in shard_files(folder):
        if not file.is_file():
            raise UserError(f"{file} is listed in the index of {folder} but missing.")
        tensors.update(read_header(file))
    return tensors
