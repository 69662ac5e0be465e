"""The piece store: a checkpoint saved under one layout loads bit for bit under another; bad input is one
sentence naming the file; a save killed midway leaves the previous checkpoint intact; metadata is never
unpickled freely. Synthetic pieces only (no model)."""

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tessera.checkpoint import CheckpointError, Piece, latest, load_pieces, prune, read_meta, save_pieces
from tessera.checkpoint.manifest import describe, read_manifest, write_manifest
from tessera.checkpoint.planners import PieceSavePlanner
from tessera.checkpoint.safe_reader import read_dcp_metadata
from tessera.checkpoint.store import step_path
from tessera.comm import CommGroup

SHAPES = {"model/w": (12, 8), "model/v": (6,), "optim/m": (10, 6), "optim/step": ()}
META = {"step": 17, "data": {"epoch": 1, "offset": 96}}


def original() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model/w": torch.randn(12, 8, generator=g), "model/v": torch.randn(6, generator=g).bfloat16(),
            "optim/m": torch.randn(10, 6, generator=g), "optim/step": torch.tensor(17)}


def zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in original().items()}


def world_group(rank: int, world_size: int) -> CommGroup:
    return CommGroup("world", dist.group.WORLD if world_size > 1 else None, tuple(range(world_size)), rank)


def flat_range(name: str, t: torch.Tensor, start: int, stop: int) -> list[Piece]:
    """The flat range [start, stop) of the 2-D ``t`` cut into rectangles, as a ZeRO shard of a flattened
    tensor is: a partial first row, whole rows, a partial last row."""
    cols, pieces = t.shape[1], []
    while start < stop:
        r, c = divmod(start, cols)
        if c or stop - start < cols:
            n = min(cols - c, stop - start)
            pieces.append(Piece(name, tuple(t.shape), (r, c), t[r:r + 1, c:c + n]))
        else:
            n = (stop - start) // cols * cols
            pieces.append(Piece(name, tuple(t.shape), (r, 0), t[r:r + n // cols]))
        start += n
    return pieces


def rows_layout(t: dict, rank: int, ws: int) -> list[Piece]:
    """Saving layout: w row-sharded, v and step replicated, m as ZeRO flat ranges (several pieces/rank)."""
    per, flat = 12 // ws, 60 // ws
    return [Piece("model/w", (12, 8), (rank * per, 0), t["model/w"][rank * per:(rank + 1) * per]),
            Piece.whole("model/v", t["model/v"]), Piece.whole("optim/step", t["optim/step"]),
            *flat_range("optim/m", t["optim/m"], rank * flat, (rank + 1) * flat)]


def columns_layout(t: dict, rank: int, ws: int) -> list[Piece]:
    """Loading layout: w and m column-sharded, v and step replicated."""
    cw, cm = 8 // ws, 6 // ws
    return [Piece("model/w", (12, 8), (0, rank * cw), t["model/w"][:, rank * cw:(rank + 1) * cw]),
            Piece("optim/m", (10, 6), (0, rank * cm), t["optim/m"][:, rank * cm:(rank + 1) * cm]),
            Piece.whole("model/v", t["model/v"]), Piece.whole("optim/step", t["optim/step"])]


def whole_layout(t: dict) -> list[Piece]:
    return [Piece.whole(k, v) for k, v in t.items()]


def pieces_equal(got: list[Piece], want: list[Piece]) -> bool:
    return all(a.name == b.name and a.offsets == b.offsets and a.tensor.dtype == b.tensor.dtype
               and torch.equal(a.tensor, b.tensor) for a, b in zip(got, want, strict=True))


# ---- multi-rank: save at 4 ranks, load at 2 ranks and in one process ----------------------------
def save_worker(rank, world_size, folder):
    save_pieces(Path(folder), rows_layout(original(), rank, world_size), META, world_group(rank, world_size))


def load_columns_worker(rank, world_size, folder):
    mine = zeros()
    meta = load_pieces(Path(folder), columns_layout(mine, rank, world_size), world_group(rank, world_size))
    return {"meta": meta, "equal": pieces_equal(columns_layout(mine, rank, world_size),
                                                columns_layout(original(), rank, world_size)),
            "others_untouched": int(mine["model/w"].count_nonzero()) == 12 * 8 // world_size}


def load_error_worker(rank, world_size, folder, extra_on_rank):
    """Only rank ``extra_on_rank`` asks for a tensor the checkpoint lacks; every rank must raise."""
    pieces = columns_layout(zeros(), rank, world_size)
    if rank == extra_on_rank:
        pieces.append(Piece.whole("model/extra", torch.zeros(3)))
    try:
        load_pieces(Path(folder), pieces, world_group(rank, world_size))
    except CheckpointError as err:
        return str(err)
    return None


def bad_save_worker(rank, world_size, folder):
    """Rank 1 hands in two pieces at the same place: every rank must fail (no hang), nothing replaced."""
    pieces = rows_layout(original(), rank, world_size)
    if rank == 1:
        pieces.append(pieces[0])
    try:
        save_pieces(Path(folder), pieces, {"step": 99}, world_group(rank, world_size))
    except RuntimeError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def saved4(rank_pool, tmp_path_factory):
    folder = tmp_path_factory.mktemp("store") / "step_000017"
    rank_pool.run(save_worker, 4, folder=str(folder))
    return folder


@pytest.mark.multirank
def test_save_at_4_ranks_writes_each_region_once(saved4):
    saved = read_dcp_metadata(saved4).state_dict_metadata
    assert {k: tuple(md.size) for k, md in saved.items()} == SHAPES
    assert len(saved["model/v"].chunks) == 1 and len(saved["optim/step"].chunks) == 1  # replicas deduplicated
    assert len(saved["model/w"].chunks) == 4 and len(saved["optim/m"].chunks) == 8
    assert sum(c.sizes.numel() for c in saved["optim/m"].chunks) == 60
    assert sorted(p.name for p in saved4.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert read_meta(saved4) == META and not saved4.with_name(saved4.name + ".partial").exists()
    files = read_manifest(saved4)["files"]  # data files hashed by the rank that wrote them
    assert sorted(files) == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "trainer.json"]
    assert all(describe(saved4 / name) == entry for name, entry in files.items())
    assert not list(saved4.glob(".sums_*"))


@pytest.mark.multirank
def test_load_at_2_ranks_column_sharded(rank_pool, saved4):
    results = rank_pool.run(load_columns_worker, 2, folder=str(saved4))
    assert [r["meta"] for r in results] == [META, META]
    assert all(r["equal"] and r["others_untouched"] for r in results)


@pytest.mark.multirank
def test_load_in_one_process_whole(saved4):
    mine = zeros()
    assert load_pieces(saved4, whole_layout(mine), CommGroup.single()) == META
    assert pieces_equal(whole_layout(mine), whole_layout(original()))


@pytest.mark.multirank
def test_an_error_on_one_rank_is_raised_on_every_rank(rank_pool, saved4):
    messages = rank_pool.run(load_error_worker, 2, folder=str(saved4), extra_on_rank=1)
    assert messages[0] == messages[1] and "model/extra" in messages[0] and ".metadata" in messages[0]


@pytest.mark.multirank
def test_a_damaged_file_checked_by_another_rank_fails_every_rank(rank_pool, saved4, tmp_path):
    bad = shutil.copytree(saved4, tmp_path / "step_000017")
    flip_byte(bad / "__2_0.distcp")  # at 2 ranks, rank 1 hashes the 2nd, 4th, 6th file in name order
    messages = rank_pool.run(load_error_worker, 2, folder=str(bad), extra_on_rank=-1)
    assert messages[0] == messages[1] and "__2_0.distcp" in messages[0] and "checksum" in messages[0]


@pytest.mark.multirank
def test_a_save_failing_on_one_rank_fails_every_rank(rank_pool, saved4, tmp_path):
    previous = shutil.copytree(saved4, tmp_path / "step_000017")
    messages = rank_pool.run(bad_save_worker, 2, folder=str(previous))
    assert all(m is not None and "two pieces of model/w" in m for m in messages)
    assert still_loads(previous) and read_meta(previous) == META


# ---- single process ------------------------------------------------------------------------------
def test_whole_tensors_round_trip_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(5, 7, generator=g), "b": torch.randn(3, generator=g).bfloat16(),
               "c": torch.randint(0, 1000, (4, 2, 3), generator=g), "d": torch.tensor(2.5, dtype=torch.float64)}
    empty = [Piece("a", (5, 7), (0, 0), torch.empty(0, 7))]  # an empty ZeRO range: nothing to write
    save_pieces(tmp_path / "ck", whole_layout(tensors) + empty, {"step": 3}, CommGroup.single())
    into = {k: torch.zeros_like(v) for k, v in tensors.items()}
    assert load_pieces(tmp_path / "ck", whole_layout(into) + empty, CommGroup.single()) == {"step": 3}
    assert pieces_equal(whole_layout(into), whole_layout(tensors))


@pytest.fixture
def good(tmp_path):
    folder = save_pieces(tmp_path / "good", rows_layout(original(), 0, 1), META, CommGroup.single())
    return folder


def flip_byte(path: Path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_fails(folder: Path, pieces: list[Piece], *needles: str) -> str:
    with pytest.raises(CheckpointError) as err:
        load_pieces(folder, pieces, CommGroup.single())
    message = str(err.value)
    assert all(n in message for n in needles), message
    assert all(int(p.tensor.count_nonzero()) == 0 for p in pieces)  # nothing was read into any piece
    return message


def still_loads(folder: Path) -> bool:
    mine = zeros()
    return load_pieces(folder, whole_layout(mine), CommGroup.single()) == META and pieces_equal(
        whole_layout(mine), whole_layout(original()))


def test_missing_folder(good):
    assert_fails(good.parent / "step_000099", whole_layout(zeros()), "step_000099", "does not exist")


def test_missing_shard_file(good, tmp_path):
    bad = shutil.copytree(good, tmp_path / "bad")
    (bad / "__0_0.distcp").unlink()
    assert_fails(bad, whole_layout(zeros()), str(bad / "__0_0.distcp"), "missing")
    assert still_loads(good)


def test_flipped_byte_in_shard_file(good, tmp_path):
    bad = shutil.copytree(good, tmp_path / "bad")
    flip_byte(bad / "__0_0.distcp")
    assert_fails(bad, whole_layout(zeros()), str(bad / "__0_0.distcp"), "checksum")
    assert still_loads(good)


def test_truncated_metadata_file(good, tmp_path):
    bad = shutil.copytree(good, tmp_path / "bad")
    (bad / ".metadata").write_bytes((bad / ".metadata").read_bytes()[:100])
    assert_fails(bad, whole_layout(zeros()), str(bad / ".metadata"), "bytes")


def test_checkpoint_of_another_model_shape(good):
    mine = zeros()
    mine["model/w"] = torch.zeros(12, 16)
    message = assert_fails(good, whole_layout(mine), "model/w", "[12, 8]", "[12, 16]", str(good / ".metadata"))
    assert message.count(".") >= 1 and "\n" not in message
    assert still_loads(good)


def test_tensor_missing_from_checkpoint(good):
    pieces = whole_layout(zeros()) + [Piece.whole("model/extra", torch.zeros(2, 2))]
    assert_fails(good, pieces, "model/extra", str(good / ".metadata"))


def test_a_region_never_saved_is_an_error(tmp_path):
    w = original()["model/w"]
    save_pieces(tmp_path / "half", [Piece("model/w", (12, 8), (0, 0), w[:6])], {}, CommGroup.single())
    assert_fails(tmp_path / "half", [Piece.whole("model/w", torch.zeros(12, 8))], "only part of model/w")


# ---- unsafe metadata -----------------------------------------------------------------------------
class Payload:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for arbitrary code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_malicious_metadata_is_refused_without_running(good, tmp_path):
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()  # the payload is live under plain pickle
    marker.unlink()
    bad = shutil.copytree(good, tmp_path / "bad")
    (bad / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    write_manifest(bad)  # an attacker can rewrite the checksums too
    assert_fails(bad, whole_layout(zeros()), str(bad / ".metadata"), "open", "refusing")
    assert not marker.exists()


# ---- atomic saves and the step folder ----------------------------------------------------------
def test_a_save_killed_midway_leaves_the_previous_checkpoint(good, monkeypatch):
    real, calls = PieceSavePlanner.resolve_data, []

    def dies_after_one_write(self, item):
        calls.append(item)
        if len(calls) == 2:
            raise RuntimeError("killed mid-save")  # as a dying rank would, after some bytes are on disk
        return real(self, item)

    newer = {k: v + 1 for k, v in original().items()}
    with monkeypatch.context() as m:
        m.setattr(PieceSavePlanner, "resolve_data", dies_after_one_write)
        with pytest.raises(RuntimeError, match="killed mid-save"):
            save_pieces(good, whole_layout(newer), {"step": 18}, CommGroup.single())
    partial = good.with_name(good.name + ".partial")
    assert partial.is_dir() and len(calls) == 2
    assert still_loads(good)
    save_pieces(good, whole_layout(newer), {"step": 18}, CommGroup.single())  # the next save cleans up
    assert not partial.exists() and not good.with_name(good.name + ".old").exists()
    mine = zeros()
    assert load_pieces(good, whole_layout(mine), CommGroup.single()) == {"step": 18}
    assert pieces_equal(whole_layout(mine), whole_layout(newer))


def test_latest_and_prune(tmp_path):
    t = {"x": torch.arange(4.0)}
    for step in (10, 20, 30):
        save_pieces(step_path(tmp_path, step), whole_layout(t), {"step": step}, CommGroup.single())
    assert step_path(tmp_path, 30).name == "step_000030"
    (tmp_path / "step_000040.partial").mkdir()  # a save killed mid-way: never resumed from
    (tmp_path / "step_000020.partial").mkdir()  # a stale leftover
    assert latest(tmp_path) == step_path(tmp_path, 30) and latest(tmp_path / "none") is None
    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_000010", "step_000020.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000020", "step_000030", "step_000040.partial"]
    assert read_meta(latest(tmp_path)) == {"step": 30}


def test_a_disk_error_while_saving_is_one_sentence(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(CheckpointError, match="saving checkpoint .*file/ck failed"):
        save_pieces(tmp_path / "file" / "ck", whole_layout(original()), {}, CommGroup.single())


def test_a_peer_lost_inside_dcps_own_collectives_is_one_sentence(tmp_path, monkeypatch):
    # DCP's planning runs collectives of its own; a peer killed meanwhile makes the backend raise a bare
    # RuntimeError there, which must read like every other collective's failure (tessera.comm), not a traceback
    import torch.distributed.checkpoint as dcp

    from tessera.errors import PeerGoneError

    def lost(*args, **kwargs):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:60800: Connection reset "
                           "by peer. This is typically caused by a remote worker hanging")

    monkeypatch.setattr(dcp, "save", lost)
    with pytest.raises(PeerGoneError, match=r"^rank 0: checkpoint saving \(DCP's planning collectives\) call #\d+ "
                                            r"on axis 'world' .* is gone: .*Connection reset by peer"):
        save_pieces(tmp_path / "ck", whole_layout({"w": torch.zeros(2)}), {"step": 1}, CommGroup.single())
