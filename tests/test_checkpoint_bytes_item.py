"""A checkpoint holding a pickled object (a DCP bytes item) is refused by tessera's load planner, and
nothing in it is unpickled."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from tessera.checkpoint import CheckpointError, Piece
from tessera.checkpoint.planners import PieceLoadPlanner
from tessera.checkpoint.safe_reader import SafeFileSystemReader, read_dcp_metadata

UNPICKLED: list[str] = []  # what unpickling the object ran


def _ran(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Payload:
    """Unpickling it calls _ran: what a crafted checkpoint could make a load run."""

    def __reduce__(self):
        return (_ran, ("payload",))


@pytest.fixture
def checkpoint(tmp_path):
    """Plain dcp.save of a state dict with a tensor and a non-tensor object (saved as a bytes item)."""
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "obj": Payload()}, checkpoint_id=tmp_path, no_dist=True)
    UNPICKLED.clear()
    return tmp_path


def test_the_checkpoint_holds_a_bytes_item_that_dcp_itself_would_unpickle(checkpoint):
    """The premise: loading it with DCP's default planner runs the object's code."""
    state = {"w": torch.zeros(2, 3), "obj": None}
    dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint), planner=DefaultLoadPlanner(), no_dist=True)
    assert UNPICKLED == ["payload"] and state["obj"] == "payload"


def test_the_piece_planner_refuses_the_bytes_item_and_unpickles_nothing(checkpoint):
    w = torch.zeros(2, 3)
    pieces = [Piece.whole("w", w), Piece.whole("obj", torch.zeros(1))]
    with pytest.raises(CheckpointException) as err:  # DCP wraps what its planning step raised
        dcp.load({}, storage_reader=SafeFileSystemReader(checkpoint), planner=PieceLoadPlanner(pieces),
                 no_dist=True)
    refusal = next(iter(err.value.failures.values()))[0]
    assert isinstance(refusal, CheckpointError)
    assert str(refusal) == ("checkpoint item obj is a pickled Python object (a DCP bytes item), not a tensor: "
                            "refusing to unpickle it (a checkpoint of tessera holds tensors only)")
    assert UNPICKLED == [] and torch.equal(w, torch.zeros(2, 3))  # nothing read at all
    # the tensor alone loads as before
    dcp.load({}, storage_reader=SafeFileSystemReader(checkpoint), planner=PieceLoadPlanner(pieces[:1]),
             no_dist=True)
    assert torch.equal(w, torch.arange(6.0).reshape(2, 3)) and UNPICKLED == []


def test_a_bytes_read_item_reaching_the_planner_is_refused_unread(checkpoint):
    """Planning never asks for one; if DCP ever handed it one, the planner refuses instead of torch.load."""
    planner = PieceLoadPlanner([])
    planner.set_up_planner({}, read_dcp_metadata(checkpoint), is_coordinator=True)
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("obj"), dest_offsets=torch.Size([]),
                    storage_index=MetadataIndex("obj"), storage_offsets=torch.Size([]), lengths=torch.Size([]))
    stream = io.BytesIO()
    torch.save(Payload(), stream)
    stream.seek(0)
    with pytest.raises(CheckpointError, match="^checkpoint item obj is a pickled Python object") as err:
        planner.load_bytes(item, stream)
    assert "\n" not in str(err.value) and UNPICKLED == [] and stream.tell() == 0
