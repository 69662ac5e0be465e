"""``tessera prepare`` and training on its token shards: formats, document boundaries, dtypes, determinism,
resume after an interruption, the sampler over several shards, refusals, and a 2-step training run."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from bpe_tokenizer import stdlib_text, train_bpe, wide_word_level
from tessera.cli import main
from tessera.errors import ConfigError
from tessera.train.data import (
    DataConfig, TokenStream, WindowSampler, check_vocabulary, load_corpus, load_tokenizer, make_batch,
)
from tessera.train.data import prepare as prepare_mod
from tessera.train.data.prepare import prepare
from tessera.train.data.documents import SplitRule, find_sources
from tessera.train.data.shards import document_offsets


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe"))


def _texts(n: int, size: int = 300) -> list[str]:
    text = stdlib_text(20000)
    return [f"doc {i}: " + text[(i * 97) % 15000:(i * 97) % 15000 + size] for i in range(n)]


def write_inputs(root, n_txt: int = 6, n_jsonl: int = 8, n_parquet: int = 8) -> dict:
    """A folder of .txt files, a .jsonl file and a .parquet file; returns {document key: text}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts, docs = iter(_texts(n_txt + n_jsonl + n_parquet)), {}
    (root / "notes").mkdir(parents=True)
    for i in range(n_txt):
        docs[f"in/notes/n{i}.txt"] = text = next(texts)
        (root / "notes" / f"n{i}.txt").write_text(text, encoding="utf-8")
    lines = []
    for i in range(n_jsonl):
        text = next(texts)
        lines.append(json.dumps({"id": i, "text": text}))
        docs[f"in/rows.jsonl#{len(lines)}"] = text
        if i == 3:
            lines.append("")  # a blank line is not a document
    (root / "rows.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    column = [next(texts) for _ in range(n_parquet)] + [None, ""]  # null and empty rows are skipped
    docs.update({f"in/table.parquet#{i}": t for i, t in enumerate(column) if t})
    pq.write_table(pa.table({"text": column, "n": list(range(len(column)))}), root / "table.parquet",
                   row_group_size=3)
    (root / "ignored.csv").write_text("a,b\n")  # not a format prepare reads from a folder
    return docs


def _prepare(inputs, out, tokenizer, **kw):
    return prepare(find_sources([str(p) for p in inputs]), str(out), tokenizer, **kw)


def _split_docs(out, meta, tokenizer) -> dict:
    """split -> the decoded documents of that split, cut at the recorded offsets (each ends with eot)."""
    found = {}
    for split in ("train", "val"):
        shards = meta["splits"][split]["shards"]
        stream = np.asarray(TokenStream([str(out / f"{split}-{s['index']:05d}.bin") for s in shards],
                                        np.dtype(meta["dtype"])))
        offsets = document_offsets(str(out), shards, split).astype(np.int64)
        assert offsets[-1] == len(stream) == meta["splits"][split]["tokens"]
        docs = [stream[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        assert all(d[-1] == tokenizer.eot and tokenizer.eot not in d[:-1] for d in docs)
        found[split] = [tokenizer.decode(d[:-1]) for d in docs]
    return found


def test_prepare_reads_txt_jsonl_and_parquet_with_document_boundaries(tmp_path, bpe):
    docs = write_inputs(tmp_path / "in")
    tok = load_tokenizer(str(bpe))
    meta = _prepare([tmp_path / "in"], tmp_path / "out", tok, val_fraction=0.2, shard_tokens=400)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == {"fingerprint": tok.fingerprint,
                                                               "vocab_size": 401, "eot": 400}
    assert [s["name"] for s in meta["sources"]] == ["in/notes/n0.txt", "in/notes/n1.txt", "in/notes/n2.txt",
                                                    "in/notes/n3.txt", "in/notes/n4.txt", "in/notes/n5.txt",
                                                    "in/rows.jsonl", "in/table.parquet"]
    assert meta["skipped_documents"] == 2  # the null and the empty parquet rows
    rule = SplitRule(list(docs) + ["in/table.parquet#8", "in/table.parquet#9"], 0.2)
    expect = {split: [t for k, t in docs.items() if rule.is_val(k) == (split == "val")] for split in ("train", "val")}
    assert expect["val"] and expect["train"]
    assert _split_docs(tmp_path / "out", meta, tok) == expect  # every document, in order, whole, once
    assert len(meta["splits"]["train"]["shards"]) > 2  # several shards, each closed at a document's end
    assert all(s["tokens"] >= 400 for s in meta["splits"]["train"]["shards"][:-1])
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").read_bytes() == (bpe / "tokenizer.json").read_bytes()


def test_byte_prepare_is_uint16_and_a_wide_vocabulary_is_uint32(tmp_path):
    for i in range(4):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"{i}.txt").write_text(f"the {i} re import of it\n" * 5, encoding="utf-8")
    byte = _prepare([tmp_path / "in"], tmp_path / "bytes", load_tokenizer("byte"), val_fraction=0.3)
    assert byte["dtype"] == "uint16" and os.path.getsize(tmp_path / "bytes" / "train-00000.bin") % 2 == 0
    wide_tok = load_tokenizer(str(wide_word_level(tmp_path / "wide")))
    wide = _prepare([tmp_path / "in"], tmp_path / "wide_out", wide_tok, val_fraction=0.3)
    assert wide["dtype"] == "uint32"
    raw = np.fromfile(tmp_path / "wide_out" / "train-00000.bin", dtype="<u4")
    assert raw[-1] == 70000 and (raw == 70000).sum() == wide["splits"]["train"]["documents"]
    assert not (tmp_path / "bytes" / "tokenizer").exists()  # nothing to copy for bytes


def _shard_bytes(out) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".bin", ".idx")}


def test_prepare_is_deterministic_and_the_stream_does_not_depend_on_shard_size(tmp_path, bpe):
    write_inputs(tmp_path / "in")
    tok = load_tokenizer(str(bpe))
    a = _prepare([tmp_path / "in"], tmp_path / "a", tok, shard_tokens=300)
    b = _prepare([tmp_path / "in"], tmp_path / "b", tok, shard_tokens=300)
    assert _shard_bytes(tmp_path / "a") == _shard_bytes(tmp_path / "b") and a["key"] == b["key"]
    one = _prepare([tmp_path / "in"], tmp_path / "one", tok, shard_tokens=10**9)
    assert len(one["splits"]["train"]["shards"]) == 1 < len(a["splits"]["train"]["shards"])
    for split in ("train", "val"):
        streams = [load_corpus(DataConfig(corpus=str(tmp_path / d), tokenizer=str(bpe), seq_len=4))
                   for d in ("a", "one")]
        assert np.array_equal(np.asarray(getattr(streams[0], split)), np.asarray(getattr(streams[1], split)))
    # preparing again into a finished folder changes nothing
    assert _prepare([tmp_path / "in"], tmp_path / "a", tok, shard_tokens=300) == a


def test_an_interrupted_prepare_resumes_to_the_same_bytes(tmp_path, bpe, monkeypatch):
    write_inputs(tmp_path / "in", n_txt=10, n_jsonl=10, n_parquet=10)
    tok = load_tokenizer(str(bpe))
    whole = _prepare([tmp_path / "in"], tmp_path / "whole", tok, shard_tokens=200)
    encoded = []
    real = tok.encode_batch

    def failing(texts):
        encoded.extend(texts)
        if len(encoded) > 15:
            raise KeyboardInterrupt  # what Ctrl-C does mid-way
        return real(texts)

    monkeypatch.setattr(prepare_mod, "_BATCH_DOCS", 2)
    monkeypatch.setattr(tok, "encode_batch", failing)
    with pytest.raises(KeyboardInterrupt):
        _prepare([tmp_path / "in"], tmp_path / "cut", tok, shard_tokens=200)
    kept = _shard_bytes(tmp_path / "cut")
    assert kept and not (tmp_path / "cut" / "meta.json").exists()
    assert (tmp_path / "cut" / ".prepare.json").exists()
    assert all(whole_bytes == kept[name] for name, whole_bytes in _shard_bytes(tmp_path / "whole").items()
               if name in kept)  # finished shards are already final
    encoded.clear()
    monkeypatch.setattr(tok, "encode_batch", lambda texts: (encoded.extend(texts), real(texts))[1])
    resumed = _prepare([tmp_path / "in"], tmp_path / "cut", tok, shard_tokens=200)
    assert _shard_bytes(tmp_path / "cut") == _shard_bytes(tmp_path / "whole")
    assert json.loads((tmp_path / "cut" / "meta.json").read_text()) == resumed == whole
    kept_docs = sum(len(b) // 8 - 1 for name, b in kept.items() if name.endswith(".idx"))
    assert kept_docs > 0 and len(encoded) == 30 - kept_docs  # finished shards' documents: not tokenised again
    assert not (tmp_path / "cut" / ".prepare.json").exists()


def test_a_changed_input_restarts_an_unfinished_prepare(tmp_path, monkeypatch):
    write_inputs(tmp_path / "in")
    tok = load_tokenizer("byte")
    calls = []
    real = prepare_mod._encode_into

    def interrupted(*args):
        calls.append(1)
        if len(calls) > 4:
            raise RuntimeError("interrupted")
        real(*args)

    monkeypatch.setattr(prepare_mod, "_BATCH_DOCS", 2)
    monkeypatch.setattr(prepare_mod, "_encode_into", interrupted)
    with pytest.raises(RuntimeError):
        _prepare([tmp_path / "in"], tmp_path / "out", tok, shard_tokens=300)
    stale = _shard_bytes(tmp_path / "out")
    assert "train-00000.bin" in stale  # finished shards of the first inputs
    monkeypatch.setattr(prepare_mod, "_encode_into", real)
    (tmp_path / "in" / "notes" / "n0.txt").write_text("changed since", encoding="utf-8")
    meta = _prepare([tmp_path / "in"], tmp_path / "out", tok, shard_tokens=300)
    assert _prepare([tmp_path / "in"], tmp_path / "fresh", tok, shard_tokens=300) == meta
    assert _shard_bytes(tmp_path / "out") == _shard_bytes(tmp_path / "fresh") != stale


def test_one_document_keeps_its_tail_for_validation(tmp_path, bpe):
    (tmp_path / "one.txt").write_text(stdlib_text(4000), encoding="utf-8")
    tok = load_tokenizer(str(bpe))
    meta = _prepare([tmp_path / "one.txt"], tmp_path / "out", tok, val_fraction=0.1)
    ids = tok.encode(stdlib_text(4000)).tolist()
    cut = len(ids) - round(len(ids) * 0.1)
    for split, part in (("train", ids[:cut]), ("val", ids[cut:])):
        assert meta["splits"][split]["documents"] == 1
        assert np.fromfile(tmp_path / "out" / f"{split}-00000.bin", dtype="<u2").tolist() == [*part, tok.eot]


def test_the_sampler_and_make_batch_read_several_shards_as_one_stream(tmp_path, bpe):
    write_inputs(tmp_path / "in")
    _prepare([tmp_path / "in"], tmp_path / "out", load_tokenizer(str(bpe)), shard_tokens=250)
    corpus = load_corpus(DataConfig(corpus=str(tmp_path / "out"), tokenizer=str(bpe), seq_len=16))
    assert isinstance(corpus.train, TokenStream) and len(corpus.train._maps) > 3
    flat = np.asarray(corpus.train)
    assert flat.dtype == np.uint16 and len(flat) == len(corpus.train)
    assert corpus.train[5] == flat[5] and corpus.train[-1] == flat[-1]
    assert np.array_equal(corpus.train[240:260], flat[240:260])  # across a shard boundary
    with pytest.raises(IndexError):
        corpus.train[np.array([len(flat)])]
    one = WindowSampler(len(corpus.train), 16, 8, 2, 0, 1, seed=3)
    ranks = [WindowSampler(len(corpus.train), 16, 8, 2, r, 2, seed=3) for r in range(2)]
    for _ in range(3):  # two ranks' batches, in rank order, are one process's batch
        single = [make_batch(corpus.train, ids, 16) for ids in one.next_step()]
        split = [make_batch(corpus.train, ids, 16) for s in ranks for ids in s.next_step()]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(single, split))
        for x, y in single:
            assert x.dtype == torch.int64 and int(x.max()) < 401
    ids = one.peek_step(0)[0]
    x, y = make_batch(corpus.train, ids, 16)
    assert torch.equal(x[0], torch.from_numpy(flat[ids[0] * 16:ids[0] * 16 + 16].astype(np.int64)))
    assert torch.equal(y[:, :-1], x[:, 1:])
    resumed = WindowSampler(len(corpus.train), 16, 8, 2, 0, 1, seed=3)
    resumed.load_state_dict(one.state_dict())
    assert all(np.array_equal(a, b) for a, b in zip(resumed.next_step(), one.next_step()))


def test_training_refuses_a_mismatched_tokenizer_and_a_small_vocabulary(tmp_path, bpe):
    write_inputs(tmp_path / "in")
    _prepare([tmp_path / "in"], tmp_path / "out", load_tokenizer(str(bpe)))
    with pytest.raises(ConfigError, match=r"prepared with another tokenizer .*--data.tokenizer=.*out/tokenizer"):
        load_corpus(DataConfig(corpus=str(tmp_path / "out")))
    ok = DataConfig(corpus=str(tmp_path / "out"), tokenizer=str(tmp_path / "out" / "tokenizer"), seq_len=8)
    assert len(load_corpus(ok).val) == prepare_mod.read_prepared(str(tmp_path / "out"))["splits"]["val"]["tokens"]
    check_vocabulary(ok, 401)
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than the 401 token ids of corpus"):
        check_vocabulary(ok, 256)
    with pytest.raises(ConfigError, match=r"model.vocab_size=300 is smaller than the 401 token ids of "
                                          r"data.tokenizer="):
        check_vocabulary(DataConfig(tokenizer=str(bpe)), 300)
    check_vocabulary(DataConfig(), 256)


def test_raw_text_with_a_tokenizer_goes_through_prepare_into_the_cache(tmp_path, bpe):
    write_inputs(tmp_path / "in")
    os.remove(tmp_path / "in" / "rows.jsonl")  # a training corpus folder is text files
    os.remove(tmp_path / "in" / "table.parquet")
    cfg = DataConfig(corpus=str(tmp_path / "in"), tokenizer=str(bpe), cache_dir=str(tmp_path / "cache"),
                     val_fraction=0.3, seq_len=8)
    corpus = load_corpus(cfg)
    assert os.path.dirname(corpus.path) == str(tmp_path / "cache" / "tokens")
    tok = load_tokenizer(str(bpe))
    docs = _split_docs(tmp_path / "cache" / "tokens" / os.path.basename(corpus.path), corpus.meta, tok)
    texts = {p.name: p.read_text(encoding="utf-8") for p in (tmp_path / "in").rglob("*") if p.is_file()}
    assert sorted(docs["train"] + docs["val"]) == sorted(texts.values()) and docs["val"]
    assert load_corpus(cfg).path == corpus.path  # built once, then found
    other = load_corpus(DataConfig(corpus=str(tmp_path / "in"), cache_dir=str(tmp_path / "cache"), seq_len=8))
    assert other.train.dtype == np.uint8  # bytes keep their own cache


@pytest.mark.parametrize("args, message", [
    (["missing", "--out", "o"], "input 'missing' does not exist"),
    (["in", "--out", "o", "--val-fraction", "0.9"], "validation fraction must be in (0, 0.5]"),
    (["in", "--out", "o", "--shard-tokens", "0"], "tokens per shard must be a positive integer"),
    (["in", "--out", "o", "--tokenizer", "nowhere"], "neither 'byte' nor a folder holding a tokenizer.json"),
    (["in/table.parquet", "--out", "o", "--text-field", "body"], "has no column 'body'"),
    (["bad.jsonl", "--out", "o"], "bad.jsonl line 2 is not valid JSON"),
    (["in", "--out", "in"], "is not empty and holds no unfinished tessera prepare"),
])
def test_prepare_refusals_are_one_sentence_and_exit_2(tmp_path, monkeypatch, capsys, args, message):
    write_inputs(tmp_path / "in")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", *args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera: error: ") and message in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_prepare_refuses_a_folder_prepared_from_other_inputs(tmp_path, monkeypatch, capsys):
    write_inputs(tmp_path / "in")
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "in", "--out", "out", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dtype"] == "uint16" and summary["train_documents"] + summary["val_documents"] == 22
    assert main(["prepare", "in", "--out", "out", "--no-progress"]) == 0  # the same: nothing to do
    capsys.readouterr()
    assert main(["prepare", "in", "--out", "out", "--val-fraction", "0.3", "--no-progress"]) == 2
    assert "already holds a corpus prepared from other inputs or settings" in capsys.readouterr().err


@pytest.mark.slow
def test_tessera_train_runs_two_steps_on_a_prepared_corpus(tmp_path, bpe, monkeypatch, capsys):
    write_inputs(tmp_path / "in", n_txt=12, n_jsonl=12, n_parquet=12)
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "in", "--out", "data", "--tokenizer", str(bpe), "--shard-tokens", "500",
                 "--no-progress"]) == 0
    capsys.readouterr()
    base = ["train", "--nproc", "1", "--model.preset=tiny", "--data.corpus=data", "--data.tokenizer=data/tokenizer",
            "--train.steps=2", "--train.eval_every=2", "--train.log_every=1", "--data.seq_len=16",
            "--data.global_batch_size=2", "--data.micro_batch_size=1", "--data.eval_batches=1",
            "--run.progress=false", "--run.name=bpe", f"--run.out_dir={tmp_path / 'runs'}"]
    assert main([*base, "--dry-run"]) == 2  # the tiny preset's 256 ids cannot hold 401 tokens
    assert "model.vocab_size=256 is smaller than the 401 token ids" in capsys.readouterr().err
    assert main([*base, "--model.vocab_size=512"]) == 0
    summary = json.loads((tmp_path / "runs" / "bpe" / "summary.json").read_text())
    assert summary["steps"] == 2 and np.isfinite(summary["val_loss_end"])
    assert summary["val_loss_start"] == pytest.approx(np.log(512), rel=0.1)  # logits over 512 ids at first


def prepared_trainer_worker(rank, world_size, args):
    from tessera.train.config import load_config
    from tessera.launch import run_rank

    return run_rank(load_config(None, args))


@pytest.mark.multirank
def test_training_on_prepared_shards_at_dp2_matches_single_process(rank_pool, tmp_path, bpe):
    """Several shards read as one stream: 2 data-parallel ranks train like one process (the parity rule)."""
    from tessera.train.config import load_config
    from tessera.launch import run_rank

    write_inputs(tmp_path / "in", n_txt=12, n_jsonl=12, n_parquet=12)
    _prepare([tmp_path / "in"], tmp_path / "data", load_tokenizer(str(bpe)), shard_tokens=500)

    def args(name):
        return ["--model.preset=tiny", "--model.vocab_size=512", f"--data.corpus={tmp_path / 'data'}",
                f"--data.tokenizer={tmp_path / 'data' / 'tokenizer'}", "--train.steps=3", "--train.log_every=1",
                "--train.eval_every=3", "--data.seq_len=16", "--data.global_batch_size=4",
                "--data.micro_batch_size=1", "--data.eval_batches=1", "--run.progress=false",
                f"--run.out_dir={tmp_path}", f"--run.name={name}", "--optim.warmup_steps=1"]

    single = run_rank(load_config(None, args("one")))
    results = rank_pool.run(prepared_trainer_worker, 2, args=args("dp2"))
    for key in ("val_loss_start", "val_loss_end", "train_loss_end"):
        assert results[0][key] == pytest.approx(single[key], rel=1e-5), key


def test_an_unreadable_input_is_one_sentence(tmp_path, monkeypatch, capsys):
    write_inputs(tmp_path / "in")
    real = open

    def denied(path, *args, **kwargs):
        if str(path).endswith("n3.txt"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("builtins.open", denied)
    assert main(["prepare", "in", "--out", "out", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "could not read or write" in err and "n3.txt (Permission denied)" in err and err.count("\n") == 1


KILLED_PREPARE = """
import os, signal, sys
from tessera.train.data import prepare as prepare_mod
from tessera.cli import main
calls, real = [], prepare_mod._encode_into
def dying(pending, tokenizer, writers):
    calls.append(1)
    if len(calls) == 6:  # mid-way, with a shard being written: no cleanup code runs
        os.kill(os.getpid(), signal.SIGKILL)
    real(pending, tokenizer, writers)
prepare_mod._encode_into, prepare_mod._BATCH_DOCS = dying, 2
main(["prepare", "in", "--out", "cut", "--shard-tokens", "600", "--no-progress"])
"""


def test_a_killed_prepare_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    import subprocess
    import sys

    write_inputs(tmp_path / "in", n_txt=10, n_jsonl=10, n_parquet=10)
    killed = subprocess.run([sys.executable, "-c", KILLED_PREPARE], cwd=tmp_path, capture_output=True)
    assert killed.returncode == -9, killed.stderr
    assert not (tmp_path / "cut" / "meta.json").exists() and _shard_bytes(tmp_path / "cut")
    monkeypatch.chdir(tmp_path)
    for out in ("cut", "whole"):
        assert main(["prepare", "in", "--out", out, "--shard-tokens", "600", "--no-progress"]) == 0
    assert _shard_bytes(tmp_path / "cut") == _shard_bytes(tmp_path / "whole")
    assert not [p.name for p in (tmp_path / "cut").iterdir() if p.name.endswith(".tmp")]
