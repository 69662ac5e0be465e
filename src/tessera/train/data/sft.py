"""Supervised fine-tuning data: prompt/response pairs whose loss counts the response tokens only.

Prepared (``tessera prepare --sft``) like any token shards (:mod:`tessera.train.data.prepare`): each JSON line
``{"prompt": ..., "response": ...}`` is one document, stored as

    prompt tokens + response tokens + eot        (prompt and response tokenised separately)

in the split's ``.bin`` / ``.idx`` shards, and its prompt's token count in a ``.prompt`` shard beside them.
Tokenising the two separately puts the boundary exactly where the user's text puts it, so the mask is
exact for any tokenizer.

Trained one example per window (padding, no packing), left-aligned: window i is example i's first
``seq_len + 1`` tokens, padded with eot. With the example's token t at position t (L tokens, P of prompt):

    x[t] = token t                       t < seq_len       (eot past the example's end)
    y[t] = token t + 1   if P <= t + 1 < L, else IGNORE_INDEX

so a target counts exactly when it is a response token or the closing eot (the model learns to stop), and
no example sees another's tokens. An example longer than ``seq_len + 1`` tokens is cut at the end (its
response's tail is not trained); one whose prompt alone is longer than ``seq_len`` tokens would train
nothing and is refused before any rank starts. Windows are examples, so the sampler's guarantees (the union
of N ranks' windows is one process's, resume at any step) hold unchanged, and the loss stays a sum over
counted targets divided by the global batch's count (``tessera.train.step``).

Shapes: B windows of a micro-batch, S = seq_len.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch

from tessera.errors import ConfigError
from tessera.train.data.documents import Source, jsonl_lines
from tessera.train.data.shards import ShardWriter, TokenStream, document_offsets, open_split, prompt_lengths
from tessera.train.step import IGNORE_INDEX


@dataclass(frozen=True)
class SFTFields:
    """The JSON fields holding an example's prompt and its response."""

    prompt: str = "prompt"
    response: str = "response"

    def check(self) -> None:
        for what, name in (("prompt", self.prompt), ("response", self.response)):
            if not isinstance(name, str) or not name:
                raise ConfigError(f"the {what} field must be a non-empty name, got {name!r}")
        if self.prompt == self.response:
            raise ConfigError(f"the prompt and response fields must differ, both are {self.prompt!r}")

    def as_dict(self) -> Dict[str, str]:
        return asdict(self)


def check_sources(sources: Sequence[Source]) -> None:
    """Fine-tuning examples come from JSON lines only: refuse any other input before reading anything."""
    for src in sources:
        if src.kind != "jsonl":
            raise ConfigError(f"{src.path} is not a .jsonl file: fine-tuning data is JSON lines of "
                              f"prompt/response pairs")


def examples(src: Source, fields: SFTFields) -> Iterator[Tuple[str, Tuple[str, str]]]:
    """(key, (prompt, response)) of every non-blank line, keyed as :func:`documents.document_keys` lists;
    a line without both texts is refused (a silently dropped example would change what is trained)."""
    for number, line in jsonl_lines(src):
        where = f"{src.path} line {number}"
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"{where} is not valid JSON") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where} is not a JSON object")
        texts = []
        for name in (fields.prompt, fields.response):
            text = record.get(name)
            if name not in record:
                raise ConfigError(f"{where} has no {name!r} field; choose the fields with --prompt-field and "
                                  f"--response-field")
            if not isinstance(text, str) or not text or "\0" in text:
                raise ConfigError(f"{where}: {name!r} must be a non-empty string without NUL, got {text!r:.40}")
            texts.append(text)
        yield f"{src.rel}#{number}", (texts[0], texts[1])


def encode_examples(pending: List[tuple], tokenizer, writers: Dict[str, ShardWriter]) -> None:
    """Tokenise a batch of ``(split, key, (prompt, response))`` and append each as prompt + response + eot
    with its prompt length."""
    if not pending:
        return
    prompts = tokenizer.encode_batch([p for _, _, (p, _) in pending])
    responses = tokenizer.encode_batch([r for _, _, (_, r) in pending])
    for (split, key, _), p_ids, r_ids in zip(pending, prompts, responses):
        for what, ids in (("prompt", p_ids), ("response", r_ids)):
            if len(ids) == 0:
                raise ConfigError(f"the {what} of example {key} encodes to no token with this tokenizer")
        writers[split].add(np.concatenate([p_ids, r_ids]), tokenizer.eot, prompt_tokens=len(p_ids))


class SFTExamples:
    """One split of fine-tuning examples: read-only tokens, each example's offsets and prompt length."""

    def __init__(self, tokens: TokenStream, offsets: np.ndarray, prompts: np.ndarray, eot: int, split: str):
        self.tokens = tokens
        self.offsets = offsets.astype(np.int64)  # [n + 1]: example i is tokens [off[i], off[i + 1]), eot included
        self.prompts = prompts.astype(np.int64)  # [n]
        self.eot, self.split = int(eot), split
        if len(self.prompts) + 1 != len(self.offsets):
            raise ConfigError(f"the {split} split's prompt lengths do not match its examples: prepare it again")

    @property
    def n_examples(self) -> int:
        return len(self.prompts)

    def batch(self, ids: Sequence[int], seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, int64 [B, S], of examples ``ids``: prompt targets and padding IGNORE_INDEX."""
        ids = np.asarray(ids, dtype=np.int64)
        start, length = self.offsets[ids], self.offsets[ids + 1] - self.offsets[ids]  # [B] each
        return padded_rows(self.tokens, start, length, self.prompts[ids], seq_len, self.eot)


def padded_rows(tokens, start: np.ndarray, length: np.ndarray, counted_from: np.ndarray, seq_len: int,
                pad: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, int64 [B, S] (S = ``seq_len``), of rows ``tokens[start : start + length]`` cut at
    S + 1 tokens, left-aligned: inputs past a row's end are ``pad``; a target counts when its position t + 1
    is inside the row and at least ``counted_from`` (a prompt's length), else it is IGNORE_INDEX."""
    pos = np.arange(seq_len + 1, dtype=np.int64)[None, :]  # [1, S + 1]
    inside = pos < length[:, None]  # [B, S + 1]
    tok_BS1 = np.asarray(tokens[start[:, None] + np.minimum(pos, length[:, None] - 1)], dtype=np.int64)
    tok_BS1[~inside] = pad
    counted = inside & (pos >= counted_from[:, None])
    target_BS1 = np.where(counted, tok_BS1, IGNORE_INDEX)
    return torch.from_numpy(tok_BS1[:, :-1].copy()), torch.from_numpy(target_BS1[:, 1:].copy())


def check_prompts_fit(meta: Dict[str, object], seq_len: int, corpus: str) -> None:
    """Refuse, from a prepared folder's meta alone (so before any rank starts), a ``seq_len`` shorter than
    its longest prompt: that example's window would hold no response token to train."""
    for split in ("train", "val"):
        longest = int(meta["splits"][split]["longest_prompt"])  # type: ignore[index]
        if longest > seq_len:
            raise ConfigError(f"the longest prompt in the {split} split of {corpus!r} has {longest} tokens, more "
                              f"than data.seq_len={seq_len}, so its response would not be trained: set "
                              f"--data.seq_len={longest} or more, or leave the longest prompts out")


def open_sft_split(folder: str, meta: Dict[str, object], split: str) -> SFTExamples:
    """A prepared fine-tuning folder's ``split`` as :class:`SFTExamples`."""
    shards = meta["splits"][split]["shards"]  # type: ignore[index]
    tokens = open_split(folder, shards, split, np.dtype(str(meta["dtype"])))
    eot = meta["tokenizer"]["eot"]  # type: ignore[index]
    missing = [s for s in shards if not os.path.isfile(os.path.join(folder, f"{split}-{s['index']:05d}.prompt"))]
    if missing:
        raise ConfigError(f"{folder} lacks the prompt lengths of its {split} shards: prepare it again")
    return SFTExamples(tokens, document_offsets(folder, shards, split), prompt_lengths(folder, shards, split),
                       int(eot), split)
