"""Supervised fine-tuning data (``tessera prepare --sft``): masks that cover exactly the prompts (bytes and
BPE), the loss as a hand-computed mean over response tokens, one example per window (cut when longer),
determinism and resume of prepare and of training, refusals, and parity of dp2 and pp2 with one process."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from bpe_tokenizer import stdlib_text, train_bpe
from tessera.cli import main
from tessera.comm.group import CommGroup
from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.train.config import load_config
from tessera.train.data import ByteTokenizer, DataConfig, WindowSampler, load_corpus, load_tokenizer, make_batch
from tessera.train.data import prepare as prepare_mod
from tessera.train.data.documents import find_sources
from tessera.train.data.prepare import prepare
from tessera.train.data.sft import SFTExamples, SFTFields
from tessera.train.step import IGNORE_INDEX, forward_backward

from test_resume import crash_after, records, same_records

SEQ = 32  # training windows in these tests; every prompt below is shorter (bytes and BPE)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe"))


def pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (prompt, response) pairs of real text: prompts of 6-25 bytes, responses of 1-40 (some examples
    are longer than a SEQ window, so they are cut)."""
    text, rng = stdlib_text(20000), random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randrange(15000), rng.randrange(15000)
        out.append((f"Q{i}: " + text[a:a + rng.randrange(1, 20)], text[b:b + rng.randrange(1, 41)]))
    return out


def write_jsonl(path, examples, prompt="prompt", response="response") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({prompt: p, response: r, "id": i}) + "\n"
                            for i, (p, r) in enumerate(examples)), encoding="utf-8")
    return str(path)


def prepared(tmp_path, name, examples, tokenizer=None, **kw):
    """Prepare ``examples`` into ``tmp_path/name``; their input file is written once per test (its name,
    size and mtime are part of what the shards depend on)."""
    src = tmp_path / "in" / "pairs.jsonl"
    if not src.exists():
        write_jsonl(src, examples)
    meta = prepare(find_sources([str(src)]), str(tmp_path / name), tokenizer or ByteTokenizer(), sft=SFTFields(),
                   **kw)
    return meta, tmp_path / name


def shard_bytes(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".bin", ".idx", ".prompt")}


# ---------------------------------------------------------------- masks


def test_windows_by_hand():
    """Two examples ("ab" -> "cd", "xyz" -> "w") with eot 0: padding and prompt targets are ignored, the
    response and the closing eot are targets; a shorter window cuts the example's end."""
    tokens = np.array([97, 98, 99, 100, 0, 120, 121, 122, 119, 0], dtype=np.uint16)
    ex = SFTExamples(tokens, np.array([0, 5, 10], dtype=np.uint64), np.array([2, 3]), eot=0, split="train")
    x, y = ex.batch([0, 1], 6)
    assert x.tolist() == [[97, 98, 99, 100, 0, 0], [120, 121, 122, 119, 0, 0]]
    assert y.tolist() == [[-100, 99, 100, 0, -100, -100], [-100, -100, 119, 0, -100, -100]]
    x, y = ex.batch([1, 0], 3)  # cut: only the first seq_len + 1 tokens of each example
    assert x.tolist() == [[120, 121, 122], [97, 98, 99]] and y.tolist() == [[-100, -100, 119], [-100, 99, 100]]
    assert x.dtype == y.dtype == torch.int64


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_masks_cover_exactly_the_prompts(tmp_path, bpe, kind):
    tok = ByteTokenizer() if kind == "byte" else load_tokenizer(str(bpe))
    examples = pairs(24)
    meta, folder = prepared(tmp_path, "sft", examples, tok, val_fraction=0.2, shard_tokens=200)
    corpus = load_corpus(DataConfig(corpus=str(folder), tokenizer="byte" if kind == "byte" else str(bpe),
                                    seq_len=200))
    seen = []
    for split in ("train", "val"):
        ex = getattr(corpus, split)
        assert isinstance(ex, SFTExamples) and ex.n_examples == meta["splits"][split]["documents"] > 0
        x, y = make_batch(ex, np.arange(ex.n_examples), 200)  # windows longer than every example
        for i in range(ex.n_examples):
            doc = np.asarray(ex.tokens[ex.offsets[i]:ex.offsets[i + 1]], dtype=np.int64)
            prompt_ids, rest = doc[:ex.prompts[i]], doc[ex.prompts[i]:]
            prompt = tok.decode(prompt_ids)
            response = dict(examples)[prompt]
            assert prompt_ids.tolist() == tok.encode(prompt).tolist()
            assert rest.tolist() == tok.encode(response).tolist() + [tok.eot]
            assert x[i, :len(doc)].tolist() == doc.tolist()
            assert y[i][y[i] != IGNORE_INDEX].tolist() == rest.tolist()  # exactly response + eot count
            assert (y[i, :len(prompt_ids) - 1] == IGNORE_INDEX).all() and (y[i, len(doc) - 1:] == IGNORE_INDEX).all()
            seen.append(prompt)
        assert meta["splits"][split]["prompt_tokens"] == int(ex.prompts.sum())
    assert sorted(seen) == sorted(p for p, _ in examples)


# ---------------------------------------------------------------- the loss


def test_the_loss_is_the_mean_over_response_tokens(tmp_path):
    """forward_backward over two micro-batches of unequal response counts equals (loss and gradients) a
    hand-written mean of -log p(next token) over every example's response tokens and eot."""
    _, folder = prepared(tmp_path, "sft", pairs(12), val_fraction=0.2)
    ex = load_corpus(DataConfig(corpus=str(folder), seq_len=SEQ)).train
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))
    ids = [np.array([0, 3, 5]), np.array([1])]
    result = forward_backward(model, [make_batch(ex, i, SEQ) for i in ids], CommGroup.single("dp"),
                              torch.device("cpu"))
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    terms = []
    for i in np.concatenate(ids):  # from the stored tokens and prompt length alone, not from the mask
        doc = torch.as_tensor(np.asarray(ex.tokens[ex.offsets[i]:ex.offsets[i + 1]], dtype=np.int64))[:SEQ + 1]
        logp = torch.log_softmax(model(doc[:-1]), dim=-1)  # [L - 1, V]
        terms += [-logp[t - 1, doc[t]] for t in range(int(ex.prompts[i]), len(doc))]
    manual = torch.stack(terms).mean()
    manual.backward()
    assert result.tokens == len(terms) and result.loss == pytest.approx(manual.item(), rel=1e-6)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- determinism and resume


def test_prepare_is_deterministic_and_an_interrupted_one_resumes(tmp_path, bpe, monkeypatch):
    tok = load_tokenizer(str(bpe))
    whole, _ = prepared(tmp_path, "whole", pairs(30), tok, shard_tokens=150)
    again, _ = prepared(tmp_path, "again", pairs(30), tok, shard_tokens=150)
    assert shard_bytes(tmp_path / "whole") == shard_bytes(tmp_path / "again") and whole["key"] == again["key"]
    assert len(whole["splits"]["train"]["shards"]) > 2
    calls, real = [], tok.encode_batch

    def failing(texts):
        calls.append(texts)
        if len(calls) > 16:  # prompts and responses of 8 batches of 2, then Ctrl-C
            raise KeyboardInterrupt
        return real(texts)

    monkeypatch.setattr(prepare_mod, "_BATCH_DOCS", 2)
    monkeypatch.setattr(tok, "encode_batch", failing)
    with pytest.raises(KeyboardInterrupt):
        prepared(tmp_path, "cut", pairs(30), tok, shard_tokens=150)
    kept = shard_bytes(tmp_path / "cut")
    assert any(name.endswith(".prompt") for name in kept) and not (tmp_path / "cut" / "meta.json").exists()
    assert len(kept) < len(shard_bytes(tmp_path / "whole"))
    monkeypatch.setattr(tok, "encode_batch", real)
    resumed, _ = prepared(tmp_path, "cut", pairs(30), tok, shard_tokens=150)
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "whole") and resumed == whole


def test_the_sampler_gives_ranks_one_processs_examples_and_resumes(tmp_path):
    _, folder = prepared(tmp_path, "sft", pairs(40), val_fraction=0.1)
    ex = load_corpus(DataConfig(corpus=str(folder), seq_len=SEQ)).train
    single = WindowSampler(ex, SEQ, 8, 8, 0, 1, seed=3)
    ranks = [WindowSampler(ex, SEQ, 8, 2, r, 2, seed=3) for r in range(2)]
    assert single.n_windows == ex.n_examples
    for _ in range(6):  # past one epoch
        whole = make_batch(ex, single.next_step()[0], SEQ)
        parts = [make_batch(ex, ids, SEQ) for s in ranks for ids in s.next_step()]
        for k in range(2):
            assert torch.equal(whole[k], torch.cat([p[k] for p in parts]))
    later = WindowSampler(ex, SEQ, 8, 8, 0, 1, seed=3)
    later.load_state_dict(single.state_dict())
    assert all(np.array_equal(a, b) for a, b in zip(later.next_step(), single.next_step()))


def train_args(out, data, name, steps=4, extra=()):
    return ["--model.preset=tiny", f"--data.corpus={data}", f"--data.seq_len={SEQ}", "--data.global_batch_size=4",
            "--data.micro_batch_size=1", "--data.eval_batches=1", f"--train.steps={steps}", "--train.log_every=1",
            f"--train.eval_every={steps}", "--optim.warmup_steps=1", "--run.progress=false",
            f"--run.out_dir={out}", f"--run.name={name}", *extra]


def train_losses(run_dir) -> list[float]:
    return [r["loss"] for r in records(run_dir) if r["kind"] == "train"]


@pytest.mark.slow
def test_a_resumed_fine_tuning_run_repeats_the_run_exactly(tmp_path):
    _, data = prepared(tmp_path, "sft", pairs(40), val_fraction=0.1)
    every = ["--checkpoint.every=2", "--checkpoint.keep=3"]
    run_rank(load_config(None, train_args(tmp_path, data, "full", extra=every)))
    crash_after(tmp_path / "full", tmp_path / "part", 2)
    resumed = run_rank(load_config(None, train_args(tmp_path, data, "part", extra=[*every,
                                                                                   "--checkpoint.resume=auto"])))
    assert resumed["resumed_from_step"] == 2
    same_records(records(tmp_path / "full"), records(tmp_path / "part"))


# ---------------------------------------------------------------- parity


def sft_trainer_worker(rank, world_size, args):
    return run_rank(load_config(None, args))


@pytest.mark.multirank
@pytest.mark.parametrize("both, layout", [
    ([], ["--parallel.dp_replicate=2"]),
    ([], ["--parallel.pp=2", "--pipeline.microbatches=2"]),
    (["--lora.rank=4"], ["--parallel.dp_replicate=2"]),  # fine-tuning with adapters, as the issue has it
], ids=["dp2", "pp2", "lora-dp2"])
def test_sft_matches_single_process(rank_pool, tmp_path, both, layout):
    """Micro-batches hold unequal numbers of response tokens; token weighting is global, so 2 ranks (data or
    pipeline parallel) give one process's losses over 4 steps."""
    meta, data = prepared(tmp_path, "sft", pairs(40), val_fraction=0.25)
    assert meta["splits"]["val"]["documents"] >= 4  # one eval batch of 4 whole windows: the same at any dp
    single = run_rank(load_config(None, train_args(tmp_path, data, "one", extra=both)))
    results = rank_pool.run(sft_trainer_worker, 2, args=train_args(tmp_path, data, "two", extra=[*both, *layout]))
    assert results[0]["world_size"] == 2 and single["world_size"] == 1
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert len(one) == 4 and np.allclose(two, one, rtol=1e-5, atol=0), (one, two)
    for key in ("val_loss_start", "val_loss_end"):
        assert results[0][key] == pytest.approx(single[key], rel=1e-5), key
    assert len(set(one)) == 4  # it trains: every step's loss differs


# ---------------------------------------------------------------- the command line


@pytest.mark.slow
def test_tessera_prepare_sft_then_train_end_to_end(tmp_path, monkeypatch, capsys):
    write_jsonl(tmp_path / "chat" / "pairs.jsonl", pairs(30), prompt="question", response="answer")
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "chat", "--out", "data", "--sft", "--prompt-field", "question",
                 "--response-field", "answer", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["train_documents"] + summary["val_documents"] == 30
    assert 0 < summary["train_response_tokens"] < summary["train_tokens"]
    assert main(["train", "--nproc", "1", *train_args(tmp_path / "runs", "data", "sft", steps=2)]) == 0
    run = json.loads((tmp_path / "runs" / "sft" / "summary.json").read_text())
    assert run["steps"] == 2 and np.isfinite(run["val_loss_end"]) and np.isfinite(run["train_loss_end"])


def test_a_prompt_longer_than_a_window_is_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    prepared(tmp_path, "sft", [("a" * 40, "b"), ("c", "d"), ("e", "f")])  # a 40-byte prompt
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", *train_args(tmp_path / "runs", "sft", "x")]) == 2
    err = capsys.readouterr().err
    assert "has 40 tokens, more than data.seq_len=32" in err and "--data.seq_len=40" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(ConfigError, match="longest prompt"):
        load_corpus(DataConfig(corpus=str(tmp_path / "sft"), seq_len=39))
    assert load_corpus(DataConfig(corpus=str(tmp_path / "sft"), seq_len=40)).train.n_examples >= 1


GOOD = '{"prompt": "a", "response": "b"}'


@pytest.mark.parametrize("lines, args, message", [
    (['{"prompt": "a"}', GOOD], [], "line 1 has no 'response' field"),
    ([GOOD, '{"prompt": "a", "response": ""}'], [], "line 2: 'response' must be a non-empty string"),
    (['{"prompt": "", "response": "b"}', GOOD], [], "'prompt' must be a non-empty string"),
    (['{"prompt": "a", "response": 3}', GOOD], [], "'response' must be a non-empty string"),
    ([GOOD, '[1, 2]'], [], "line 2 is not a JSON object"),
    ([GOOD, '{oops'], [], "line 2 is not valid JSON"),
    ([GOOD, ""], [], "needs at least two examples"),  # a blank line is no example
    (['{"q": "a", "r": "b"}', GOOD], ["--prompt-field", "q"], "has no 'response' field"),
    ([GOOD, GOOD], ["--prompt-field", "q", "--response-field", "q"], "fields must differ"),
])
def test_sft_refusals_are_one_sentence_and_exit_2(tmp_path, monkeypatch, capsys, lines, args, message):
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "in.jsonl", "--out", "o", "--sft", *args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera: error: ") and message in err and err.count("\n") == 1, err


def test_sft_takes_json_lines_only_and_fields_need_sft(tmp_path, monkeypatch, capsys):
    (tmp_path / "notes.txt").write_text("plain text")
    write_jsonl(tmp_path / "in.jsonl", pairs(3))
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "notes.txt", "in.jsonl", "--out", "o", "--sft", "--no-progress"]) == 2
    assert "notes.txt is not a .jsonl file" in capsys.readouterr().err
    assert main(["prepare", "in.jsonl", "--out", "o", "--prompt-field", "q", "--no-progress"]) == 2
    assert "add --sft" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was written
