"""Tokenizers: bytes (no vocabulary file) or a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

Both kinds answer the same questions: ``vocab_size`` (ids are below it), ``eot`` (the id that ends a
document in a token stream), ``encode(text)`` / ``decode(ids)``, ``encode_batch(texts)`` and
``fingerprint`` (what a token cache is keyed by: ``"byte"``, or a hash of ``tokenizer.json``).
:func:`load_tokenizer` picks one from a spec: ``"byte"`` or a folder holding ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

from tessera.errors import ConfigError

# Tokens that end a document in common vocabularies, tried in this order when tokenizer_config.json names
# no eos_token: GPT-2 / Qwen, Llama 2 / Mistral, Llama 3, ChatML, Gemma.
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>")
# The files of a Hugging Face tokenizer folder that travel with its tokenizer.json (prepare, export).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back.

    Documents are joined with byte 0 (NUL) as an end-of-text marker: NUL never
    appears in text files, so it cannot collide with real content.
    """

    vocab_size: int = 256
    eot: int = 0
    fingerprint: str = "byte"
    spec: str = "byte"

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """Return the UTF-8 bytes of ``text`` as a uint8 array (bytes have no special tokens to add)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Union[np.ndarray, Iterable[int]]) -> str:
        """Turn token ids back into text; a window may cut a multi-byte
        character in half, so invalid sequences are replaced, not raised."""
        data = np.asarray(ids, dtype=np.int64)
        return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer read from ``<folder>/tokenizer.json``.

    ``encode`` adds no special tokens by default (no BOS): a training document is its text's tokens
    followed by ``eot``, nothing else. ``decode`` keeps special tokens, as ``transformers`` does.
    """

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer

        path = os.path.join(folder, "tokenizer.json")
        try:
            with open(path, "rb") as f:
                raw = f.read()
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # OSError, UnicodeDecodeError, or the bare Exception tokenizers raises
            raise ConfigError(f"{path} is not a tokenizer.json the tokenizers library can read ({e})") from e
        self.spec = folder
        self.fingerprint = hashlib.sha256(raw).hexdigest()[:16]
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # ids may have gaps (added tokens placed high): every id must be below vocab_size
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eot = self._find_eot(folder)

    def _find_eot(self, folder: str) -> int:
        """The end-of-document id: tokenizer_config.json's eos_token, else a well-known one."""
        named = _config_eos(os.path.join(folder, "tokenizer_config.json"))
        for token in ([named] if named else []) + list(EOT_CANDIDATES):
            found = self._tok.token_to_id(token)
            if found is not None:
                return int(found)
        raise ConfigError(f"tokenizer {folder!r} has no end-of-document token: name one as eos_token in its "
                          f"tokenizer_config.json, or add one of {', '.join(EOT_CANDIDATES)}")

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """Token ids of ``text`` as an int64 array."""
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        """``encode`` of each text (the library tokenises a batch on several threads)."""
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def copy_files(self, dest: str) -> None:
        """Copy this tokenizer's files (:data:`TOKENIZER_FILES` it has) into folder ``dest`` (created)."""
        os.makedirs(dest, exist_ok=True)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(self.spec, name)):
                shutil.copyfile(os.path.join(self.spec, name), os.path.join(dest, name))

    def decode(self, ids: Union[np.ndarray, Iterable[int]]) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def _config_eos(path: str) -> Optional[str]:
    """eos_token of a tokenizer_config.json (a string, or a dict with "content"), if there is one."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        raise ConfigError(f"{path} is not a JSON object") from None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def check_tokenizer_spec(spec: str, what: str = "data.tokenizer") -> None:
    """Refuse a spec that is neither "byte" nor a folder holding tokenizer.json (cheap: reads nothing)."""
    if spec == "byte":
        return
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"{what} must be 'byte' or a folder holding a tokenizer.json, got {spec!r}")
    if not os.path.isfile(os.path.join(os.path.expanduser(spec), "tokenizer.json")):
        raise ConfigError(f"{what}={spec!r} is neither 'byte' nor a folder holding a tokenizer.json")


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` → :class:`ByteTokenizer`; a folder holding ``tokenizer.json`` → :class:`HFTokenizer`."""
    check_tokenizer_spec(spec, "tokenizer")
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(os.path.expanduser(spec))


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype every id of the vocabulary fits: uint16 up to 65536 ids, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)
