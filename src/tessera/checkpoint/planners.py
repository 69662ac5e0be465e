"""DCP planners that write and read :class:`~tessera.checkpoint.pieces.Piece` s instead of a state_dict.

Saving: each piece becomes one ``WriteItem`` of type SHARD whose chunk is the piece's rectangle
(``ChunkStorageMetadata(offsets, sizes)``) inside a tensor of the piece's global shape, so the files
record global coordinates and never the layout that wrote them. Replicated pieces (same name and offsets
on several ranks) share one ``MetadataIndex`` and DCP's ``dedup_save_plans`` keeps one copy.

Loading: for each piece, ``create_read_items_for_chunk_list`` intersects its rectangle with every saved
chunk of that name (DCP's resharding); each read item lands in the piece's view narrowed to the overlap.
A name saved as a DCP bytes item (``LoadItemType.BYTE_IO``: a pickled object) is refused, never unpickled.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.pieces import Piece


def _key(name: str, offsets) -> tuple[str, tuple[int, ...]]:
    return name, tuple(int(o) for o in offsets)


def _index(pieces: list[Piece]) -> dict[tuple[str, tuple[int, ...]], Piece]:
    """Pieces by (name, offsets); two pieces of one rank at the same place would be read/written twice.
    Empty pieces (an empty ZeRO range) hold nothing and are left out: their offsets may coincide with
    a real piece's, which DCP would take for a replica."""
    found: dict[tuple[str, tuple[int, ...]], Piece] = {}
    for p in pieces:
        if p.tensor.numel() == 0:
            continue
        key = _key(p.name, p.offsets)
        if key in found:
            raise ValueError(f"two pieces of {p.name} on one rank start at offsets {list(p.offsets)}")
        found[key] = p
    return found


def narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The view of ``t`` starting at ``offsets`` with size ``lengths`` (0-d tensors: ``t`` itself)."""
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, int(o), int(n))
    return t


def piece_chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=torch.Size(piece.tensor.shape))


def _write_item(piece: Piece) -> WriteItem:
    chunk = piece_chunk(piece)
    return WriteItem(
        index=MetadataIndex(piece.name, chunk.offsets),
        type=WriteItemType.SHARD,  # SHARD even for whole tensors: several chunks per name are allowed
        tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(piece.tensor),
                                    size=torch.Size(piece.global_shape)),
    )


def _compact_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on CPU in a storage of its own size: ``torch.save`` of a view writes the view's whole storage
    (a slice of a flat ZeRO shard would write the full shard), and DCP's writer accepts CPU tensors only."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.cpu()  # a fresh, compact tensor
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


class PieceSavePlanner(DefaultSavePlanner):
    """Writes this rank's pieces; the state_dict given to ``dcp.save`` is ignored (pass ``{}``)."""

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._given = pieces

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        # indexed here, inside DCP's collective step: an error on one rank is then raised on all
        self.pieces = _index(self._given)
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([_write_item(p) for p in self.pieces.values()])
        return self.plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """Replicas must agree on their size: DCP's dedup keys on (name, offsets) alone."""
        sizes: dict[MetadataIndex, torch.Size] = {}
        for plan in all_plans:
            for item in plan.items:
                seen = sizes.setdefault(item.index, item.tensor_data.chunk.sizes)
                if seen != item.tensor_data.chunk.sizes:
                    raise ValueError(f"pieces of {item.index.fqn} at offsets {list(item.index.offset)} have "
                                     f"sizes {list(seen)} and {list(item.tensor_data.chunk.sizes)} on two ranks")
        return super()._dedup_save_plans(all_plans)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return _compact_cpu(self.pieces[_key(write_item.index.fqn, write_item.index.offset)].tensor)


class PieceLoadPlanner(DefaultLoadPlanner):
    """Fills this rank's pieces in place from whatever chunks were saved (the caller checked names and
    shapes first, see ``store.load_pieces``); the state_dict given to ``dcp.load`` is ignored."""

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._given = pieces

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.pieces = _index(self._given)  # inside DCP's collective step, as when saving
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for p in self.pieces.values():
            saved = self.metadata.state_dict_metadata.get(p.name)
            if not isinstance(saved, TensorStorageMetadata):
                raise _not_a_tensor(p.name, saved)
            items += read_items(p, saved)
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        """Never reached by a plan of ours (it holds tensor items only); refused rather than DCP's
        ``torch.load(weights_only=False)``, which would run whatever the pickled bytes name."""
        raise _not_a_tensor(read_item.dest_index.fqn, None, pickled=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The piece's own storage narrowed to the overlap: DCP's reader copies into it (casting dtype
        and device as needed), so nothing is left for ``commit_tensor`` to do."""
        piece = self.pieces[_key(read_item.dest_index.fqn, read_item.dest_index.offset)]
        return narrow(piece.tensor.detach(), read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _not_a_tensor(name: str, saved, pickled: bool = False) -> CheckpointError:
    if pickled or isinstance(saved, BytesStorageMetadata):  # LoadItemType.BYTE_IO: a pickled object
        return CheckpointError(f"checkpoint item {name} is a pickled Python object (a DCP bytes item), not a "
                               f"tensor: refusing to unpickle it (a checkpoint of tessera holds tensors only)")
    return CheckpointError(f"checkpoint holds no tensor {name}: it was saved from another model or configuration")


def read_items(piece: Piece, saved: TensorStorageMetadata) -> list[ReadItem]:
    return create_read_items_for_chunk_list(piece.name, saved, [piece_chunk(piece)])


def covered(piece: Piece, saved: TensorStorageMetadata) -> bool:
    """Whether the saved chunks cover the piece's whole rectangle (they never overlap: DCP checks that
    when it saves), so a load never leaves part of a piece unset."""
    if piece.tensor.dim() == 0:
        return len(saved.chunks) > 0
    return sum(int(torch.Size(r.lengths).numel()) for r in read_items(piece, saved)) == piece.tensor.numel()
