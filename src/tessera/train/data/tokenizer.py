"""Byte-level tokenizer: every UTF-8 byte is a token, so no vocabulary file is needed."""

from __future__ import annotations

from typing import Iterable, Union

import numpy as np


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back.

    Documents are joined with byte 0 (NUL) as an end-of-text marker: NUL never
    appears in text files, so it cannot collide with real content.
    """

    vocab_size: int = 256
    eot: int = 0

    def encode(self, text: str) -> np.ndarray:
        """Return the UTF-8 bytes of ``text`` as a uint8 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Union[np.ndarray, Iterable[int]]) -> str:
        """Turn token ids back into text; a window may cut a multi-byte
        character in half, so invalid sequences are replaced, not raised."""
        data = np.asarray(ids, dtype=np.int64)
        return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
