"""Which token windows each data-parallel rank trains and evaluates on, step by step.

The token stream is cut into windows of ``seq_len + 1`` tokens at stride ``seq_len``
(the extra token is the last target); fine-tuning data has one window per example
(:mod:`tessera.train.data.sft`). Sample indices are counted over the whole
run, so the data order depends only on (seed, global_batch_size), never on how
many ranks share a step: the union over ranks of one step, in rank order, is
exactly what a single process gets. Parity tests rely on that.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from tessera.errors import ConfigError
from tessera.train.data.sft import SFTExamples
from tessera.train.data.shards import TokenStream

# What the windows are cut from: a split (token array or stream, or fine-tuning examples), or a token count.
Split = Union[int, np.ndarray, TokenStream, SFTExamples]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_rank(dp_rank: int, dp_size: int) -> None:
    _check_positive(dp_size=dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank {dp_rank} is outside [0, {dp_size}) for dp_size {dp_size}")


def _n_windows(data: Split, seq_len: int, what: str) -> int:
    if isinstance(data, SFTExamples):
        return data.n_examples
    if hasattr(data, "n_rows"):  # document rows of length bucketing (tessera.train.data.bucketing)
        return int(data.n_rows)  # type: ignore[union-attr]
    n_tokens = data if isinstance(data, (int, np.integer)) else len(data)
    n = (int(n_tokens) - 1) // seq_len
    if n < 1:
        raise ConfigError(f"the {what} split has {n_tokens} tokens, fewer than "
                          f"seq_len + 1 = {seq_len + 1} needed for one window")
    return n


def _split_rank(ids: np.ndarray, dp_rank: int, dp_size: int, micro_batch_size: int) -> List[np.ndarray]:
    """This rank's contiguous share of one global batch, cut into micro-batches in order."""
    per_rank = len(ids) // dp_size
    mine = ids[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [mine[k:k + micro_batch_size] for k in range(0, len(mine), micro_batch_size)]


class WindowSampler:
    """Deterministic, resumable assignment of training windows to steps, ranks and micro-batches."""

    def __init__(self, n_tokens: Split, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, shuffle: bool = True) -> None:
        """``n_tokens``: the training split itself, or its token count."""
        _check_positive(seq_len=seq_len, global_batch_size=global_batch_size,
                        micro_batch_size=micro_batch_size)
        _check_rank(dp_rank, dp_size)
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ConfigError(
                f"global_batch_size {global_batch_size} is not divisible by micro_batch_size "
                f"{micro_batch_size} times dp_size {dp_size} (= {micro_batch_size * dp_size})")
        if seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        self.n_windows = _n_windows(n_tokens, seq_len, "training")
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.samples_consumed = 0
        # Only one epoch's permutation is kept: a run of many epochs must not
        # grow memory, and a step spans at most two epochs.
        self._perm_epoch: Optional[int] = None
        self._perm: Optional[np.ndarray] = None
        self.padded = self.positions = 0  # target positions (padding, all) of the steps since take_padding()

    @property
    def accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.samples_consumed // self.n_windows

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (at this global batch size)."""
        return self.samples_consumed // self.global_batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            # PCG64 seeded by (seed, epoch): same order on every machine and rank,
            # and each epoch is reshuffled independently of the others.
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(self.n_windows)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def _windows(self, start: int, count: int) -> np.ndarray:
        """Window ids of global sample indices [start, start + count)."""
        idx = np.arange(start, start + count, dtype=np.int64)
        if not self.shuffle:
            return idx % self.n_windows
        out = np.empty(count, dtype=np.int64)
        epochs = idx // self.n_windows
        for e in np.unique(epochs):  # ascending, so the later epoch stays cached
            sel = epochs == e
            out[sel] = self._permutation(int(e))[idx[sel] % self.n_windows]
        return out

    def _split(self, ids: np.ndarray) -> List[np.ndarray]:
        return _split_rank(ids, self.dp_rank, self.dp_size, self.micro_batch_size)

    def _rank_step(self, start: int) -> List[np.ndarray]:
        return self._split(self._windows(start, self.global_batch_size))

    def _make_step(self, split, start: int) -> Tuple[List[Tuple[torch.Tensor, torch.Tensor]], int, int]:
        """(this rank's micro-batches, padded target positions of the whole step, all its positions)."""
        ids = self._windows(start, self.global_batch_size)
        padded = 0
        if isinstance(split, SFTExamples):  # an example shorter than seq_len + 1 tokens is padded
            length = np.minimum(split.offsets[ids + 1] - split.offsets[ids], self.seq_len + 1)
            padded = int((self.seq_len - (length - 1)).sum())
        return ([make_batch(split, m, self.seq_len) for m in self._split(ids)], padded,
                self.seq_len * len(ids))

    def next_batches(self, split) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches (inputs, targets) of the next step, cut from ``split``; advances and
        counts the step's padding (over every rank: the step's rows are known to each)."""
        batches, padded, positions = self._make_step(split, self.samples_consumed)
        self.samples_consumed += self.global_batch_size
        self.padded += padded
        self.positions += positions
        return batches

    def take_padding(self) -> float:
        """Padded target positions ÷ all target positions of the steps since the last call; resets."""
        fraction = self.padded / self.positions if self.positions else 0.0
        self.padded = self.positions = 0
        return fraction

    def next_step(self) -> List[np.ndarray]:
        """This rank's micro-batches (int64 window ids each) for the next step; advances."""
        out = self._rank_step(self.samples_consumed)
        self.samples_consumed += self.global_batch_size
        return out

    def peek_step(self, step: int) -> List[np.ndarray]:
        """This rank's micro-batches for optimizer step ``step`` (0-based), without advancing."""
        return self._rank_step(int(step) * self.global_batch_size)

    def state_dict(self) -> Dict[str, object]:
        return {"samples_consumed": self.samples_consumed, "seed": self.seed,
                "n_windows": self.n_windows, "shuffle": self.shuffle,
                "global_batch_size": self.global_batch_size, "padding": [self.padded, self.positions]}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Resume where ``state`` left off; refuse a state whose data order would differ."""
        for name in ("seed", "n_windows", "shuffle"):
            if name in state and state[name] != getattr(self, name):
                raise ConfigError(f"cannot resume the data sampler: checkpoint has {name}="
                                  f"{state[name]!r} but this run has {getattr(self, name)!r}")
        self.samples_consumed = int(state["samples_consumed"])  # type: ignore[arg-type]
        self.padded, self.positions = (int(v) for v in state.get("padding", (0, 0)))  # type: ignore[union-attr]


def make_batch(tokens: Union[np.ndarray, TokenStream, SFTExamples], window_ids: Sequence[int], seq_len: int
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, both int64 [len(window_ids), seq_len], on the CPU (fine-tuning
    examples: prompt and padding targets IGNORE_INDEX, :meth:`SFTExamples.batch`)."""
    if isinstance(tokens, SFTExamples):
        return tokens.batch(window_ids, seq_len)
    starts = np.asarray(window_ids, dtype=np.int64) * seq_len
    # One gather of every window (seq_len + 1 tokens each) from the memmap.
    chunk = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    full = torch.from_numpy(chunk)
    return full[:, :-1].contiguous(), full[:, 1:].contiguous()


def eval_windows(n_tokens: Split, seq_len: int, global_batch_size: int, eval_batches: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int) -> List[List[np.ndarray]]:
    """A fixed set of validation windows: this rank's micro-batches for each eval batch.

    ``global_batch_size * eval_batches`` windows spread evenly over the whole split
    (text at its start alone may be unrepresentative). With fewer windows than that,
    all are used, trimmed to a multiple of dp_size so every rank gets the same number
    of micro-batches; if there are fewer windows than ranks, some are repeated.
    """
    _check_positive(seq_len=seq_len, global_batch_size=global_batch_size,
                    eval_batches=eval_batches, micro_batch_size=micro_batch_size)
    _check_rank(dp_rank, dp_size)
    n_windows = _n_windows(n_tokens, seq_len, "validation")
    count = min(global_batch_size * eval_batches, n_windows)
    count = max(dp_size, count - count % dp_size)
    ids = (np.arange(count, dtype=np.int64) * n_windows) // count
    if count > n_windows:  # fewer windows than ranks: reuse, never leave a rank empty
        ids = np.arange(count, dtype=np.int64) % n_windows
    batch = max(dp_size, global_batch_size - global_batch_size % dp_size)
    return [_split_rank(ids[b:b + batch], dp_rank, dp_size, micro_batch_size)
            for b in range(0, count, batch)]
