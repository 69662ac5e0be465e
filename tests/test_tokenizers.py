"""Tokenizers: bytes, and Hugging Face tokenizer.json folders read with the tokenizers library (pure tier)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bpe_tokenizer import EOT, stdlib_text, train_bpe, wide_word_level
from tessera.errors import ConfigError
from tessera.train.data import ByteTokenizer, HFTokenizer, load_tokenizer
from tessera.train.data.tokenizer import token_dtype


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe"))


def test_byte_spec_gives_the_byte_tokenizer():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eot, tok.fingerprint) == (256, 0, "byte")
    ids = tok.encode("héllo")
    assert list(ids) == list("héllo".encode("utf-8")) and tok.decode(ids) == "héllo"
    assert [list(x) for x in tok.encode_batch(["a", "bc"])] == [[97], [98, 99]]


def test_bpe_folder_gives_an_hf_tokenizer_that_round_trips(bpe):
    tok = load_tokenizer(str(bpe))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 401 and tok.eot == 400  # 400 learned ids, then the special token
    text = stdlib_text(3000)
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and 0 <= ids.min() and ids.max() < tok.vocab_size
    assert len(ids) < len(text.encode("utf-8")) / 1.5  # merges were learned: fewer tokens than bytes
    assert tok.decode(ids) == text
    batch = tok.encode_batch([text[:100], text[100:250], ""])
    assert [list(b) for b in batch] == [list(tok.encode(t)) for t in (text[:100], text[100:250], "")]
    assert tok.eot not in ids  # documents carry no special tokens; eot is added between them
    assert tok.decode([*tok.encode("x = 1"), tok.eot]) == "x = 1" + EOT


def test_our_ids_equal_transformers_fast_tokenizer(bpe):
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast(tokenizer_file=str(bpe / "tokenizer.json"))
    text = stdlib_text(2000)
    assert list(load_tokenizer(str(bpe)).encode(text)) == theirs.encode(text, add_special_tokens=False)


def test_fingerprint_follows_the_tokenizer_json(tmp_path, bpe):
    again = train_bpe(tmp_path / "again")
    other = train_bpe(tmp_path / "other", vocab_size=350)
    first = load_tokenizer(str(bpe)).fingerprint
    assert load_tokenizer(str(again)).fingerprint == first  # training is deterministic
    assert load_tokenizer(str(other)).fingerprint != first


def test_eos_token_of_tokenizer_config_wins(tmp_path):
    folder = train_bpe(tmp_path / "tok")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["</s>"])
    tok.save(str(folder / "tokenizer.json"))
    assert load_tokenizer(str(folder)).eot == 400  # <|endoftext|> comes first among the known ones
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_tokenizer(str(folder)).eot == 401
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOT}}))
    assert load_tokenizer(str(folder)).eot == 400


def test_a_tokenizer_without_an_end_of_document_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="no end-of-document token.*eos_token"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("spec, match", [
    ("", "must be 'byte' or a folder holding a tokenizer.json"),
    ("no/such/folder", "neither 'byte' nor a folder holding a tokenizer.json"),
])
def test_bad_specs_are_refused(spec, match):
    with pytest.raises(ConfigError, match=match):
        load_tokenizer(spec)


def test_unreadable_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a tokenizer.json the tokenizers library can read"):
        load_tokenizer(str(tmp_path))


def test_token_dtype_is_the_narrowest_that_fits(tmp_path):
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    wide = load_tokenizer(str(wide_word_level(tmp_path / "wide")))
    assert wide.vocab_size == 70001 and wide.eot == 70000 and token_dtype(wide.vocab_size) == np.uint32
