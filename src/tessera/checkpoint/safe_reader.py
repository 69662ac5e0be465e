"""Reading a DCP checkpoint without unpickling arbitrary objects.

DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``: a crafted file would run
any code it names. :func:`read_dcp_metadata` unpickles it with :class:`MetadataUnpickler`, whose
``find_class`` admits only the classes a DCP metadata file is made of (found by tracing real files:
DCP's metadata dataclasses, ``_StorageInfo``, ``torch.Size``, torch dtypes and layouts, the ``pathlib``
path DCP records as ``checkpoint_id``) and refuses everything else with a :class:`CheckpointError` that
names the file, before anything is called. Tensor data is read by DCP itself with
``torch.load(weights_only=True)`` (``FileSystemReader.read_data``), which admits tensors and plain
containers only; a bytes item (a pickled object), which DCP would hand to its planner's
``torch.load(weights_only=False)``, is refused by ``planners.PieceLoadPlanner``. So no step of a load
executes code from the checkpoint.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from tessera.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"  # DCP's name for the global metadata file

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},  # + every torch.dtype, checked by value below
    "torch.serialization": {"_get_layout"},  # maps a layout's name ("torch.strided") to the layout
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "builtins": {"set", "frozenset"},
}


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the names in ``_ALLOWED`` (and torch dtypes)."""

    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"checkpoint file {self.source} names {module}.{name}, which a checkpoint's "
                              f"metadata never holds: refusing to load it (the file is damaged or unsafe)")


def read_dcp_metadata(folder: Path) -> Metadata:
    """The DCP metadata of the checkpoint in ``folder``, unpickled with :class:`MetadataUnpickler`."""
    path = Path(folder) / METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete") from None
    except Exception as err:  # truncated or garbled pickle stream
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(err).__name__}: {err}): "
                              f"it is damaged") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint file {path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with metadata read by :func:`read_dcp_metadata` (tensor data: DCP's own
    ``torch.load(weights_only=True)``). Give it the metadata already read to skip a second parse."""

    def __init__(self, path: Path, metadata: Metadata | None = None):
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's per-rank fallback: our saves always write the global file
            raise CheckpointError(f"checkpoint {self.path} has no {METADATA_FILE} file")
        metadata = self._metadata if self._metadata is not None else read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
