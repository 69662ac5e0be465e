"""Training data: tokens from a cached text corpus or a prepared folder (or its prompt/response examples),
sampled deterministically per rank.

No torch.distributed here: ranks and sizes come in as plain ints, so every piece
works (and is tested) in one process.
"""

from tessera.train.data.corpus import Corpus, DataConfig, check_vocabulary, load_corpus
from tessera.train.data.prepare import read_prepared
from tessera.train.data.sampler import WindowSampler, eval_windows, make_batch
from tessera.train.data.sft import SFTExamples, SFTFields
from tessera.train.data.shards import TokenStream
from tessera.train.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "DataConfig",
    "Corpus",
    "load_corpus",
    "check_vocabulary",
    "read_prepared",
    "TokenStream",
    "SFTExamples",
    "SFTFields",
    "WindowSampler",
    "make_batch",
    "eval_windows",
]
