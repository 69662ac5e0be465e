"""Tiny tokenizers built locally for tests (nothing is downloaded): a byte-level BPE trained on a few KB
of standard-library text, and a word-level one whose end-of-document id needs uint32."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"


def stdlib_text(n_bytes: int = 6000) -> str:
    """A few KB of real text every machine has: the start of the standard library's textwrap.py."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    return path.read_text(encoding="utf-8")[:n_bytes]


def train_bpe(folder: Path, vocab_size: int = 400, eos_in_config: bool = False) -> Path:
    """A byte-level BPE of ``vocab_size`` ids plus an <|endoftext|> special token (the last id), saved as
    folder/tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = stdlib_text()
    tok.train_from_iterator([text[i:i + 500] for i in range(0, len(text), 500)], trainer)
    tok.add_special_tokens([EOT])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if eos_in_config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOT}}))
    return folder


def wide_word_level(folder: Path) -> Path:
    """Whitespace words of a small vocabulary whose end-of-document id is 70000 (vocab_size 70001)."""
    words = sorted(set(stdlib_text(2000).split()))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}, EOT: 70000}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOT])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder
