"""Sequence-length bucketing (``data.bucketing=length``): rows cut by hand, padding never counted in the loss
(a bucketed step equals its documents run one by one unpadded), N ranks' micro-batches are one process's,
resume at any step, less padding than fixed windows, trainer parity with one process at dp2, pp2 and
cp2 × tp2 with sequence parallelism (a step's length a multiple of lcm(bucket_multiple, 2·cp, tp)), a
resumed bucketed run repeating the run, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.comm.group import CommGroup
from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.models import Transformer, cross_entropy_sum
from tessera.models.config import model_config
from tessera.train.config import load_config, validate_config
from tessera.train.data import DataConfig, WindowSampler, load_corpus
from tessera.train.data.bucketing import POOL_STEPS, BucketSampler, document_rows, step_multiple
from tessera.train.data.sft import SFTExamples, padded_rows
from tessera.train.step import IGNORE_INDEX, forward_backward

from test_resume import crash_after, records, same_records
from test_sft import pairs, prepared, sft_trainer_worker, train_args, train_losses

SEQ = 32


def steps_of(sampler, split, n):
    return [sampler.next_batches(split) for _ in range(n)]


# ---------------------------------------------------------------- rows and batches by hand


def test_rows_of_documents_and_examples_by_hand():
    """Token documents longer than seq_len + 1 are split at stride seq_len (every token a target once);
    a one-token document has no target; examples are one row each, cut at seq_len + 1."""
    stream = np.array([5, 6, 7, 0, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 0, 0], dtype=np.uint8)
    rows = document_rows(stream, 4, eot=0)
    assert rows.start.tolist() == [0, 4, 6, 10, 14] and rows.length.tolist() == [4, 2, 5, 5, 3]
    assert rows.counted_from.tolist() == [0] * 5  # the last document ("0" alone) holds no target
    x, y = padded_rows(stream, rows.start, rows.length, rows.counted_from, 4, 0)
    assert x.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 3, 0, 0]]
    assert y.tolist() == [[6, 7, 0, -100], [0, -100, -100, -100], [2, 3, 4, 5], [6, 7, 8, 9], [3, 0, -100, -100]]
    sampler = BucketSampler(rows, 4, 2, 1, 0, 1, seed=0, multiple=2, pad_id=0)
    for _ in range(POOL_STEPS):  # a step's length: its longest row's targets rounded up to 2
        ids = sampler._step_rows(sampler.samples_consumed)
        batches = sampler.next_batches(stream)
        want = -(-int(rows.length[ids].max() - 1) // 2) * 2
        assert {x.shape for x, _ in batches} == {(1, want)}
    ex = SFTExamples(np.array([97, 98, 99, 100, 0, 120, 121, 0], dtype=np.uint16),
                     np.array([0, 5, 8], dtype=np.uint64), np.array([2, 1]), eot=0, split="train")
    rows = document_rows(ex, 3, eot=0)
    assert rows.length.tolist() == [4, 3] and rows.counted_from.tolist() == [2, 1]
    assert step_multiple(8, tp=2, cp=3, sequence_parallel=True) == 24
    assert step_multiple(8, tp=2, cp=1, sequence_parallel=False) == 8


# ---------------------------------------------------------------- the loss


def padded_sft_step(tmp_path):
    """A fine-tuning corpus's first bucketed step (8 rows of up to SEQ tokens in 4 micro-batches): the examples,
    its rows, the step's row ids and its micro-batches."""
    _, folder = prepared(tmp_path, "sft", pairs(24), val_fraction=0.2)
    ex = load_corpus(DataConfig(corpus=str(folder), seq_len=SEQ)).train
    sampler = BucketSampler(document_rows(ex, SEQ, ex.eot), SEQ, 8, 4, 0, 1, seed=1, multiple=8, pad_id=ex.eot)
    return ex, sampler.rows, sampler._step_rows(0), sampler.next_batches(ex)


def test_padding_is_never_counted(tmp_path):
    """One bucketed step through a causal transformer: its loss and gradients equal those of its rows run
    one by one, unpadded, summed and divided by their counted targets."""
    ex, rows, ids, batches = padded_sft_step(tmp_path)
    assert any(bool((y == IGNORE_INDEX).any()) for _, y in batches)  # there is padding to leak
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", vocab_size=256, dropout=0.0))
    result = forward_backward(model, batches, CommGroup.single("dp"), torch.device("cpu"))
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for i in ids:  # each row alone, exactly its tokens
        doc = torch.as_tensor(np.asarray(ex.tokens[rows.start[i]:rows.start[i] + rows.length[i]], np.int64))
        y = doc[1:].clone()
        y[:max(int(rows.counted_from[i]) - 1, 0)] = IGNORE_INDEX  # the prompt's targets
        s, n = cross_entropy_sum(model(doc[None, :-1]), y[None], ignore_index=IGNORE_INDEX)
        total, count = total + s.double(), count + int(n)
    (total / count).backward()
    assert result.tokens == count and result.loss == pytest.approx(float(total.detach() / count), rel=1e-6)
    for g, p in zip(grads, model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- order, ranks, resume, padding


def test_ranks_share_one_processs_step_and_resume(tmp_path):
    """Over 40 steps (several pools and epochs): dp2's micro-batches, in rank order, are one process's, every
    micro-batch of a step has the same length, and a sampler restored from a state dict continues exactly."""
    _, folder = prepared(tmp_path, "sft", pairs(40), val_fraction=0.1)
    ex = load_corpus(DataConfig(corpus=str(folder), seq_len=SEQ)).train
    rows = document_rows(ex, SEQ, ex.eot)
    single = BucketSampler(rows, SEQ, 8, 4, 0, 1, seed=3, multiple=8, pad_id=0)
    ranks = [BucketSampler(rows, SEQ, 8, 2, r, 2, seed=3, multiple=8, pad_id=0) for r in range(2)]
    lengths = set()
    for step in range(40):
        whole = single.next_batches(ex)
        parts = [b for s in ranks for b in s.next_batches(ex)]
        assert len({x.shape[1] for x, _ in whole + parts}) == 1
        lengths.add(whole[0][0].shape[1])
        for k in range(2):
            assert torch.equal(torch.cat([b[k] for b in whole]), torch.cat([b[k] for b in parts]))
        if step == 17:
            state = single.state_dict()
            later = BucketSampler(rows, SEQ, 8, 4, 0, 1, seed=3, multiple=8, pad_id=0)
            later.load_state_dict(state)
    assert len(lengths) > 1 and all(L % 8 == 0 or L == SEQ for L in lengths)
    again = BucketSampler(rows, SEQ, 8, 4, 0, 1, seed=3, multiple=8, pad_id=0)
    for _ in range(18):
        again.next_batches(ex)
    for a, b in zip(steps_of(later, ex, 22), steps_of(again, ex, 22)):  # steps 18.. as uninterrupted
        assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


def test_bucketing_pads_less_than_fixed_windows(tmp_path):
    """On examples of mixed lengths the padding fraction falls, and the targets trained stay the same."""
    _, folder = prepared(tmp_path, "sft", pairs(64), val_fraction=0.1)
    ex = load_corpus(DataConfig(corpus=str(folder), seq_len=64)).train
    fixed = WindowSampler(ex, 64, 16, 16, 0, 1, seed=0)
    bucketed = BucketSampler(document_rows(ex, 64, ex.eot), 64, 16, 16, 0, 1, seed=0, multiple=8, pad_id=ex.eot)
    n = POOL_STEPS  # one pool: the same samples as fixed windows' first n steps, in another order
    fixed_targets = sum(int(y.ne(IGNORE_INDEX).sum()) for b in steps_of(fixed, ex, n) for _, y in b)
    bucket_targets = sum(int(y.ne(IGNORE_INDEX).sum()) for b in steps_of(bucketed, ex, n) for _, y in b)
    a, b = fixed.take_padding(), bucketed.take_padding()
    assert 0 < b < a and b < 0.5 * a, (a, b)
    assert fixed.take_padding() == 0.0  # reset
    assert bucket_targets == fixed_targets


# ---------------------------------------------------------------- the trainer


BUCKET = ["--data.bucketing=length", "--data.bucket_multiple=8"]


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    """The prepared SFT folder every layout trains on, made once for this module."""
    return prepared(tmp_path_factory.mktemp("bucketing_data"), "sft", pairs(40), val_fraction=0.25)[1]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, sft_data):
    """The one-process bucketed run (multiple 8) each layout is compared with: its train losses, made once."""
    out = tmp_path_factory.mktemp("bucketing_one")
    single = run_rank(load_config(None, train_args(out, sft_data, "one", extra=BUCKET)))
    lines = [r for r in records(out / "one") if r["kind"] == "train"]
    assert single["steps"] == 4 and all(0 <= r["padding_fraction"] < 1 for r in lines)
    return train_losses(out / "one")


@pytest.mark.multirank
@pytest.mark.parametrize("nproc, layout", [
    (2, ["--parallel.dp_replicate=2"]),
    (2, ["--parallel.pp=2", "--pipeline.microbatches=2"]),
    # multiple 2 asked for, but a step's L must split into 2·cp chunks and tp sequence slices: lcm(2, 4, 2) = 4
    (4, ["--parallel.cp=2", "--parallel.tp=2", "--tensor_parallel.sequence_parallel=true",
         "--data.bucket_multiple=2"]),
], ids=["dp2", "pp2", "cp2xtp2-sp"])
def test_bucketed_training_matches_single_process(rank_pool, tmp_path, sft_data, one_process, nproc, layout):
    """N ranks' bucketed losses equal one process's over 4 steps (padding is never counted, so the cp × tp
    case, padded to multiples of 4 instead of 8, gives the same losses too)."""
    rank_pool.run(sft_trainer_worker, nproc, args=train_args(tmp_path, sft_data, "n", extra=[*BUCKET, *layout]))
    got = train_losses(tmp_path / "n")
    assert len(one_process) == 4 and np.allclose(got, one_process, rtol=1e-5, atol=0), (one_process, got)


def test_a_resumed_bucketed_run_repeats_the_run(tmp_path):
    _, data = prepared(tmp_path, "sft", pairs(40), val_fraction=0.1)
    every = [*BUCKET, "--checkpoint.every=2", "--checkpoint.keep=3"]
    run_rank(load_config(None, train_args(tmp_path, data, "full", extra=every)))
    crash_after(tmp_path / "full", tmp_path / "part", 2)
    resumed = run_rank(load_config(None, train_args(tmp_path, data, "part", extra=[*every,
                                                                                   "--checkpoint.resume=auto"])))
    assert resumed["resumed_from_step"] == 2
    full, part = records(tmp_path / "full"), records(tmp_path / "part")
    same_records(full, part)
    pad = [[r["padding_fraction"] for r in rs if r["kind"] == "train"] for rs in (full, part)]
    assert pad[0] == pad[1] and len(set(pad[0])) > 1


def test_refusals(tmp_path):
    _, data = prepared(tmp_path, "sft", pairs(12), val_fraction=0.25)
    moe = [*BUCKET, "--model.num_experts=2"]  # routing leaves padding out, on every pipeline stage too
    validate_config(load_config(None, train_args(tmp_path, data, "m", extra=moe)), 1)
    validate_config(load_config(None, train_args(tmp_path, data, "m", extra=[
        *moe, "--parallel.pp=2", "--model.n_layers=2"])), 2)
    with pytest.raises(ConfigError, match="data.bucket_multiple"):
        validate_config(load_config(None, train_args(tmp_path, data, "n", extra=["--data.bucket_multiple=4"])), 1)
    with pytest.raises(ConfigError, match="data.bucketing must be"):
        DataConfig(bucketing="sorted").validate()
