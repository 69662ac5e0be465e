"""Sequence-length bucketing (``data.bucketing = "length"``): documents batched by length, little padding.

Rows. A split's documents become rows of at most ``seq_len + 1`` tokens (the extra token is the last
target), each inside one document:

- fine-tuning examples: one row per example, cut at ``seq_len + 1`` tokens as without bucketing;
- prepared token shards (their ``.idx`` document offsets) and the byte corpus (documents end with the NUL
  end-of-text byte): a document longer than ``seq_len + 1`` tokens is split into windows at stride
  ``seq_len`` (every token is a target exactly once, as with fixed windows); its last window is shorter.

Steps. The sampler's sample indices are those of :class:`WindowSampler` (one permutation per epoch of the
rows); ``POOL_STEPS`` consecutive steps form a pool whose rows are sorted by length (longest first, ties in
sample order), cut into steps of ``global_batch_size`` rows, and the pool's steps are taken in an order
drawn from (seed, pool). So the rows of a step have similar lengths, the data order depends only on (seed,
global_batch_size) and the step, never on the number of ranks (the union of N ranks' micro-batches of a
step, in rank order, is one process's), and any step can be rebuilt from ``samples_consumed`` (resume).

Shapes. Every micro-batch of a step is [B, L] with L the step's longest row's targets rounded up to the
step multiple, at most ``seq_len``: one L per step, so pipeline stages, context-parallel shards and
sequence-parallel slices see equal shapes on every rank. The multiple is ``data.bucket_multiple`` raised to
a multiple of 2·cp (context parallelism's zig-zag chunks) and of tp under sequence parallelism
(:func:`step_multiple`). Targets past a row's end are IGNORE_INDEX and its inputs there the end-of-text id:
never counted in the loss (``tessera.train.step``), and unseen by the row's real positions (causal
attention). Validation keeps fixed windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple, Union

import numpy as np
import torch

from tessera.errors import ConfigError
from tessera.train.data.sampler import WindowSampler
from tessera.train.data.sft import SFTExamples, padded_rows
from tessera.train.data.shards import TokenStream
from tessera.train.data.tokenizer import ByteTokenizer

POOL_STEPS = 16  # steps whose rows are sorted together: more gives less padding, less mixing of lengths


@dataclass
class DocumentRows:
    """Rows to train on: each ``tokens[start : start + length]`` (2 <= length <= seq_len + 1), whose
    targets count from position ``counted_from`` (a fine-tuning prompt's length; 0 otherwise). int64 [n]."""

    start: np.ndarray
    length: np.ndarray
    counted_from: np.ndarray

    @property
    def n_rows(self) -> int:
        return len(self.start)


def _doc_bounds(split: Union[np.ndarray, TokenStream], eot: int) -> Tuple[np.ndarray, np.ndarray]:
    """(start, end) int64 [n_docs] of the documents of a token split, each ending with its eot."""
    offsets = getattr(split, "doc_offsets", None)
    if offsets is None:  # the byte corpus: documents are cut by the NUL byte no text file holds
        ends = np.flatnonzero(np.asarray(split) == eot).astype(np.int64) + 1
        if len(ends) == 0 or ends[-1] != len(split):
            ends = np.append(ends, len(split))
        offsets = np.concatenate([[0], ends])
    offsets = np.asarray(offsets, dtype=np.int64)
    return offsets[:-1], offsets[1:]


def document_rows(split: Union[np.ndarray, TokenStream, SFTExamples], seq_len: int, eot: int) -> DocumentRows:
    """The rows of a split (see the module docstring); refuses a split with none."""
    if isinstance(split, SFTExamples):
        start = split.offsets[:-1]
        length = np.minimum(split.offsets[1:] - start, seq_len + 1)
        rows = DocumentRows(start, length, split.prompts.copy())
    else:
        a, b = _doc_bounds(split, eot)
        lens = b - a
        pieces = np.where(lens >= 2, (lens - 2) // seq_len + 1, 0)  # windows holding at least one target
        first = np.cumsum(pieces) - pieces
        j = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(first, pieces)  # window index in its doc
        start = np.repeat(a, pieces) + j * seq_len
        length = np.minimum(np.repeat(b, pieces) - start, seq_len + 1)
        rows = DocumentRows(start, length, np.zeros_like(start))
    if rows.n_rows == 0:
        raise ConfigError("the training split has no document of two tokens or more to train on")
    return rows


def step_multiple(bucket_multiple: int, tp: int, cp: int, sequence_parallel: bool) -> int:
    """The multiple every step's L is rounded up to: the user's, covering what the layout needs."""
    need = [bucket_multiple, 2 * cp if cp > 1 else 1, tp if (sequence_parallel and tp > 1) else 1]
    return math.lcm(*need)


class BucketSampler(WindowSampler):
    """:class:`WindowSampler` over document rows, a step's rows of similar length (module docstring)."""

    def __init__(self, rows: DocumentRows, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, multiple: int, pad_id: int) -> None:
        super().__init__(rows, seq_len, global_batch_size, micro_batch_size, dp_rank, dp_size, seed)
        self.rows, self.multiple, self.pad_id = rows, int(multiple), int(pad_id)

    def _step_rows(self, start: int) -> np.ndarray:
        """Row ids of the step whose first global sample index is ``start``: [global_batch_size]."""
        g = self.global_batch_size
        step = start // g
        pool = step // POOL_STEPS
        ids = self._windows(pool * POOL_STEPS * g, POOL_STEPS * g)
        ids = ids[np.argsort(-self.rows.length[ids], kind="stable")]  # longest first, ties in sample order
        order = np.random.Generator(np.random.PCG64([self.seed, pool, 1])).permutation(POOL_STEPS)
        k = int(order[step % POOL_STEPS])
        return ids[k * g:(k + 1) * g]

    def _rank_step(self, start: int) -> List[np.ndarray]:  # next_step / peek_step: this rank's row ids
        return self._split(self._step_rows(start))

    def step_length(self, ids: np.ndarray) -> int:
        """L of the step of rows ``ids``: its longest row's targets rounded up to the multiple, ≤ seq_len."""
        longest = int(self.rows.length[ids].max()) - 1
        return min(self.seq_len, -(-longest // self.multiple) * self.multiple)

    def _make_step(self, split, start: int) -> Tuple[List[Tuple[torch.Tensor, torch.Tensor]], int, int]:
        ids = self._step_rows(start)
        L = self.step_length(ids)
        r = self.rows
        mine = self._split(ids)
        tokens = split.tokens if isinstance(split, SFTExamples) else split
        batches = [padded_rows(tokens, r.start[m], r.length[m], r.counted_from[m], L, self.pad_id) for m in mine]
        padded = int(np.maximum(L - (r.length[ids] - 1), 0).sum())
        return batches, padded, L * len(ids)


def make_sampler(corpus, cfg, dp_rank: int, dp_size: int, tp: int, cp: int) -> WindowSampler:
    """The training sampler ``cfg.data.bucketing`` asks for (``cfg`` a JobConfig, ``corpus`` a
    :class:`~tessera.train.data.corpus.Corpus`): fixed windows, or length buckets of document rows."""
    d = cfg.data
    if d.bucketing == "none":
        return WindowSampler(corpus.train, d.seq_len, d.global_batch_size, d.micro_batch_size, dp_rank, dp_size,
                             d.seed)
    made = corpus.meta.get("tokenizer")  # a prepared folder's; the byte corpus has none
    eot = int(made["eot"]) if isinstance(made, dict) else ByteTokenizer.eot
    multiple = step_multiple(d.bucket_multiple, tp, cp, cfg.tensor_parallel.sequence_parallel)
    return BucketSampler(document_rows(corpus.train, d.seq_len, eot), d.seq_len, d.global_batch_size,
                         d.micro_batch_size, dp_rank, dp_size, d.seed, multiple, eot)
