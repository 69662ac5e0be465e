"""Training data: byte tokens from a cached text corpus, sampled deterministically per rank.

No torch.distributed here: ranks and sizes come in as plain ints, so every piece
works (and is tested) in one process.
"""

from tessera.train.data.corpus import Corpus, DataConfig, load_corpus
from tessera.train.data.sampler import WindowSampler, eval_windows, make_batch
from tessera.train.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "DataConfig",
    "Corpus",
    "load_corpus",
    "WindowSampler",
    "make_batch",
    "eval_windows",
]
