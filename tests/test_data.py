"""Training data: tokenizer, corpus cache, window sampler, eval windows (pure tier, no ranks)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from tessera.errors import ConfigError
from tessera.train.data import (
    ByteTokenizer, DataConfig, WindowSampler, eval_windows, load_corpus, make_batch,
)
from tessera.train.data import corpus as corpus_mod


# ---------------------------------------------------------------- helpers


def _docs(tokens: np.ndarray) -> list:
    """Documents of a split: each one is followed by the end-of-text byte."""
    data = np.asarray(tokens).tobytes()
    assert data.endswith(b"\0")
    return data[:-1].split(b"\0")


def _write_folder(root, n_files: int = 12, size: int = 400) -> None:
    for i in range(n_files):
        sub = root / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:03d}.txt").write_text(f"document {i} héllo\n" * (size // 20), encoding="utf-8")


def _load_worker(cfg_kwargs, barrier, queue) -> None:
    build = corpus_mod._build

    def counted_build(*args, **kwargs):
        queue.put("built")
        return build(*args, **kwargs)

    corpus_mod._build = counted_build
    barrier.wait()  # both processes start building at the same moment
    queue.put(load_corpus(DataConfig(**cfg_kwargs)).meta)


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory):
    cfg = DataConfig(cache_dir=str(tmp_path_factory.mktemp("stdlib_cache")))
    start = time.perf_counter()
    corpus = load_corpus(cfg)
    elapsed = time.perf_counter() - start
    print(f"\nstdlib corpus build: {elapsed:.2f}s, {corpus.meta['n_files']} files, "
          f"train {corpus.meta['n_train_tokens']} / val {corpus.meta['n_val_tokens']} tokens")
    return cfg, corpus


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "plain ascii, héllo wörld, 日本語, emoji 🎉\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.from_numpy(ids.astype(np.int64))) == text
    assert tok.vocab_size == 256 and tok.eot == 0
    assert tok.decode(ids[:-2][-5:]).endswith("\ufffd")  # a cut character is replaced, not raised


# ---------------------------------------------------------------- stdlib corpus


def test_stdlib_corpus_split_is_per_file(stdlib_corpus):
    cfg, corpus = stdlib_corpus
    meta = corpus.meta
    assert corpus.train.dtype == np.uint8 and not corpus.train.flags.writeable
    assert len(corpus.train) == meta["n_train_tokens"] and len(corpus.val) == meta["n_val_tokens"] > 0
    assert meta["n_train_tokens"] > 1_000_000
    # Rebuild the expected split from the files themselves: every usable file lands
    # whole in exactly one split, so no validation file is ever trained on.
    _, _, files = corpus_mod._list_sources("stdlib")
    usable = {rel: corpus_mod._read_text(path) for rel, path, _, _ in files}
    usable = {rel: data for rel, data in usable.items() if data is not None}
    train_rels, val_rels = corpus_mod._split_files(sorted(usable), cfg.val_fraction)
    assert val_rels and not set(train_rels) & set(val_rels)
    assert len(train_rels) + len(val_rels) == meta["n_files"] == len(usable)
    assert _docs(corpus.val) == [usable[rel] for rel in val_rels]
    assert _docs(corpus.train) == [usable[rel] for rel in train_rels]
    assert not any("site-packages" in rel or "__pycache__" in rel for rel in usable)


def test_stdlib_corpus_is_deterministic(stdlib_corpus, tmp_path):
    _, first = stdlib_corpus
    second = load_corpus(DataConfig(cache_dir=str(tmp_path)))
    assert second.meta == first.meta
    assert np.array_equal(second.train, first.train) and np.array_equal(second.val, first.val)


def test_second_load_is_served_from_cache(stdlib_corpus, monkeypatch):
    cfg, first = stdlib_corpus

    def no_build(*args, **kwargs):
        raise AssertionError("cache was rebuilt")

    monkeypatch.setattr(corpus_mod, "_build", no_build)
    again = load_corpus(cfg)
    assert again.meta == first.meta and again.path == first.path
    assert sorted(os.listdir(again.path)) == [".lock", "meta.json", "train.bin", "val.bin"]


# ---------------------------------------------------------------- local corpora


def test_folder_corpus_skips_binary_and_hidden(tmp_path):
    root = tmp_path / "texts"
    _write_folder(root)
    (root / "blob.bin").write_bytes(b"abc\0def")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    cfg = DataConfig(corpus=str(root), cache_dir=str(tmp_path / "cache"), val_fraction=0.3, seq_len=16)
    corpus = load_corpus(cfg)
    assert corpus.meta["n_files"] == 12
    docs = _docs(corpus.train) + _docs(corpus.val)
    expected = [p.read_bytes() for p in sorted(root.glob("part*/*.txt"))]
    assert sorted(docs) == sorted(expected)
    assert _docs(corpus.val) and _docs(corpus.train)


def test_single_file_corpus_splits_tail(tmp_path):
    text = "".join(f"line {i}: ünïcödé ✓\n" for i in range(500))
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    cfg = DataConfig(corpus=str(path), cache_dir=str(tmp_path / "cache"), val_fraction=0.1, seq_len=32)
    corpus = load_corpus(cfg)
    (train,), (val,) = _docs(corpus.train), _docs(corpus.val)
    assert train + val == text.encode("utf-8")
    assert abs(len(val) - 0.1 * len(train + val)) < 4
    val.decode("utf-8")  # the cut does not split a character
    assert corpus.meta["n_files"] == 1


def test_missing_path_names_the_path(tmp_path):
    missing = str(tmp_path / "no" / "such" / "corpus")
    with pytest.raises(ConfigError, match="no/such/corpus"):
        load_corpus(DataConfig(corpus=missing, cache_dir=str(tmp_path)))


@pytest.mark.parametrize("field,value", [
    ("val_fraction", 0.0), ("val_fraction", 0.6), ("seq_len", 0),
    ("global_batch_size", -1), ("micro_batch_size", 0), ("eval_batches", 0),
])
def test_config_validation(field, value):
    with pytest.raises(ConfigError, match=field):
        DataConfig(**{field: value}).validate()


def test_train_split_shorter_than_window(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("just a few words here\n")
    with pytest.raises(ConfigError, match="seq_len"):
        load_corpus(DataConfig(corpus=str(path), cache_dir=str(tmp_path / "c"), seq_len=128))


def test_cache_key_changes_when_a_file_changes(tmp_path):
    root = tmp_path / "texts"
    _write_folder(root)
    cfg = DataConfig(corpus=str(root), cache_dir=str(tmp_path / "cache"), val_fraction=0.3, seq_len=16)
    before = load_corpus(cfg)
    target = root / "part0" / "doc000.txt"
    target.write_text("changed text, now a different length\n" * 5)
    after = load_corpus(cfg)
    assert after.meta["key"] != before.meta["key"] and after.path != before.path
    assert target.read_bytes() in _docs(after.train) + _docs(after.val)
    other = load_corpus(DataConfig(corpus=str(root), cache_dir=cfg.cache_dir, val_fraction=0.4, seq_len=16))
    assert other.meta["key"] != after.meta["key"]  # val_fraction is part of the key


def test_concurrent_build_yields_one_valid_cache(tmp_path):
    root = tmp_path / "texts"
    _write_folder(root, n_files=300, size=20_000)
    kwargs = dict(corpus=str(root), cache_dir=str(tmp_path / "cache"), val_fraction=0.1, seq_len=16)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_load_worker, args=(kwargs, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    messages = [queue.get(timeout=120) for _ in range(3)]  # one build, two metas
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert messages.count("built") == 1 and queue.empty()
    metas = [m for m in messages if m != "built"]
    assert metas[0] == metas[1]
    key_dirs = os.listdir(tmp_path / "cache" / "corpus")
    assert key_dirs == [metas[0]["key"]]
    assert sorted(os.listdir(tmp_path / "cache" / "corpus" / key_dirs[0])) == [
        ".lock", "meta.json", "train.bin", "val.bin"]  # no stray temp files
    reference = load_corpus(DataConfig(**dict(kwargs, cache_dir=str(tmp_path / "ref"))))
    built = load_corpus(DataConfig(**kwargs))
    assert np.array_equal(built.train, reference.train) and np.array_equal(built.val, reference.val)


# ---------------------------------------------------------------- sampler


def _tokens_for(n_windows: int, seq_len: int) -> int:
    return n_windows * seq_len + 1


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("global_bs,micro_bs", [(8, 1), (8, 2), (16, 4), (16, 1)])
def test_union_over_ranks_equals_single_process(dp_size, global_bs, micro_bs):
    if global_bs % (micro_bs * dp_size):
        pytest.skip("not a valid split")
    n_tokens, seq_len = _tokens_for(37, 8), 8  # 37 windows: steps straddle epoch ends
    single = WindowSampler(n_tokens, seq_len, global_bs, global_bs, 0, 1, seed=3)
    ranks = [WindowSampler(n_tokens, seq_len, global_bs, micro_bs, r, dp_size, seed=3)
             for r in range(dp_size)]
    for _ in range(12):
        expected = np.concatenate(single.next_step())
        per_rank = [s.next_step() for s in ranks]
        for micro in per_rank:
            assert len(micro) == ranks[0].accum_steps == global_bs // (micro_bs * dp_size)
            assert all(m.dtype == np.int64 and len(m) == micro_bs for m in micro)
        got = np.concatenate([np.concatenate(micro) for micro in per_rank])
        assert np.array_equal(got, expected)


def test_every_window_once_per_epoch_and_epochs_reshuffle():
    n_windows = 40
    sampler = WindowSampler(_tokens_for(n_windows, 4), 4, 8, 4, 0, 1, seed=0)
    epochs = []
    for e in range(3):
        assert sampler.epoch == e
        epochs.append(np.concatenate([np.concatenate(sampler.next_step()) for _ in range(5)]))
        assert sorted(epochs[-1]) == list(range(n_windows))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    plain = WindowSampler(_tokens_for(n_windows, 4), 4, 8, 4, 0, 1, seed=0, shuffle=False)
    assert np.array_equal(np.concatenate(plain.next_step()), np.arange(8))
    other_seed = WindowSampler(_tokens_for(n_windows, 4), 4, 8, 4, 0, 1, seed=1)
    assert not np.array_equal(np.concatenate(other_seed.next_step()), epochs[0][:8])


def test_epoch_straddling_steps_cover_both_epochs():
    sampler = WindowSampler(_tokens_for(37, 4), 4, 8, 8, 0, 1, seed=5)
    stream = np.concatenate([sampler.next_step()[0] for _ in range(10)])  # 80 samples
    assert sorted(stream[:37]) == list(range(37)) and sorted(stream[37:74]) == list(range(37))


def test_state_dict_resumes_exactly():
    args = (_tokens_for(50, 8), 8, 8, 2, 1, 2)
    first = WindowSampler(*args, seed=7)
    for _ in range(9):
        first.next_step()
    state = first.state_dict()
    assert state["samples_consumed"] == 72 and state["seed"] == 7
    resumed = WindowSampler(*args, seed=7)
    resumed.load_state_dict(state)
    for step in range(9, 20):
        peeked = resumed.peek_step(step)
        a, b = first.next_step(), resumed.next_step()
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert all(np.array_equal(x, y) for x, y in zip(a, peeked))
    with pytest.raises(ConfigError, match="seed"):
        WindowSampler(*args, seed=8).load_state_dict(state)


def test_divisibility_error_names_the_numbers():
    with pytest.raises(ConfigError) as err:
        WindowSampler(1000, 8, 12, 4, 0, 2, seed=0)
    message = str(err.value)
    assert "12" in message and "4" in message and "2" in message


def test_make_batch_shifts_targets_by_one(stdlib_corpus):
    tokens = (np.arange(10 * 6 + 1) % 256).astype(np.uint8)
    x, y = make_batch(tokens, np.array([0, 3, 9]), 6)
    assert x.dtype == torch.long and x.shape == y.shape == (3, 6)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[1], torch.arange(18, 24)) and torch.equal(y[2], torch.arange(55, 61))
    _, corpus = stdlib_corpus  # works straight on the memmap, up to its last window
    last = (len(corpus.val) - 1) // 128 - 1
    x, y = make_batch(corpus.val, [0, last], 128)
    assert torch.equal(y[1, -1], torch.tensor(int(corpus.val[last * 128 + 128])))


# ---------------------------------------------------------------- eval windows


def test_eval_windows_fixed_sharded_and_spread():
    n_tokens, seq_len = _tokens_for(1000, 16), 16
    single = eval_windows(n_tokens, seq_len, 16, 8, 4, 0, 1)
    again = eval_windows(n_tokens, seq_len, 16, 8, 4, 0, 1)
    assert all(np.array_equal(a, b) for sa, sb in zip(single, again) for a, b in zip(sa, sb))
    flat = np.concatenate([np.concatenate(batch) for batch in single])
    assert len(flat) == 128 == len(set(flat.tolist()))
    assert flat.min() == 0 and flat.max() > 0.95 * 1000  # the whole split, not its start
    for dp_size in (2, 4):
        shards = [eval_windows(n_tokens, seq_len, 16, 8, 4, r, dp_size) for r in range(dp_size)]
        for b in range(8):  # per eval batch, ranks in order rebuild the single-process batch
            union = np.concatenate([np.concatenate(shard[b]) for shard in shards])
            assert np.array_equal(union, np.concatenate(single[b]))


@pytest.mark.parametrize("n_windows,dp_size", [(5, 1), (5, 4), (3, 4), (1, 2)])
def test_eval_windows_with_few_windows(n_windows, dp_size):
    shards = [eval_windows(_tokens_for(n_windows, 8), 8, 16, 8, 4, r, dp_size) for r in range(dp_size)]
    sizes = [[len(m) for batch in shard for m in batch] for shard in shards]
    assert all(s == sizes[0] and sum(s) >= 1 for s in sizes)  # every rank equally busy
    ids = np.concatenate([np.concatenate([np.concatenate(b) for b in shard]) for shard in shards])
    assert ids.max() < n_windows
    with pytest.raises(ConfigError, match="validation"):
        eval_windows(8, 8, 16, 8, 4, 0, 1)
