"""Training text: gather a corpus, split it train/validation, cache it as tokens.

The default corpus is the source of the running Python's standard library: real
text that every machine already has, so training needs no download. The cache
holds ``train.bin``/``val.bin`` (uint8, one byte per token) that ``np.memmap``
maps without loading, plus ``meta.json``, which is written last and so marks a
complete cache. A corpus folder written by ``tessera prepare``, or raw text with a Hugging Face
``data.tokenizer``, is read as token shards instead (:mod:`tessera.train.data.prepare`); one prepared with
``--sft`` as prompt/response examples (:mod:`tessera.train.data.sft`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
from tqdm import tqdm

from tessera.errors import ConfigError
from tessera.train.data.documents import SplitRule, text_sources
from tessera.train.data.documents import read_text_bytes as _read_text
from tessera.train.data.files import built_once, temp_writer, write_json
from tessera.train.data.prepare import is_prepared, prepare, read_prepared
from tessera.train.data.sft import SFTExamples, check_prompts_fit, open_sft_split
from tessera.train.data.shards import TokenStream, document_offsets, open_split
from tessera.train.data.tokenizer import ByteTokenizer, check_tokenizer_spec, load_tokenizer

_FORMAT = 1  # bump when the cache layout or split rule changes, so old caches are not reused
_EOT = bytes([ByteTokenizer.eot])

# (relative POSIX path, absolute path, size, mtime_ns)
SourceFile = Tuple[str, str, int, int]


BUCKETING = ("none", "length")  # data.bucketing: fixed windows, or documents batched by length (bucketing.py)


@dataclass
class DataConfig:
    """Where the text comes from and how it is cut into batches."""

    corpus: str = "stdlib"
    tokenizer: str = "byte"
    cache_dir: str = ""
    val_fraction: float = 0.02
    seq_len: int = 128
    global_batch_size: int = 16
    micro_batch_size: int = 4
    seed: int = 0
    eval_batches: int = 8
    bucketing: str = "none"  # "length": a step's rows are documents of similar length (data/bucketing.py)
    bucket_multiple: int = 8  # with bucketing, a step's length is rounded up to a multiple of this

    def validate(self) -> None:
        """Raise ConfigError for a value that cannot work."""
        if self.bucketing not in BUCKETING:
            raise ConfigError(f"data.bucketing must be 'none' or 'length', got {self.bucketing!r}")
        for name in ("seq_len", "global_batch_size", "micro_batch_size", "eval_batches", "bucket_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"data.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"data.seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.val_fraction, (int, float)) or not 0.0 < self.val_fraction <= 0.5:
            raise ConfigError(f"data.val_fraction must be in (0, 0.5], got {self.val_fraction!r}")
        if self.corpus != "stdlib" and not os.path.exists(os.path.expanduser(self.corpus)):
            raise ConfigError(f"corpus path {self.corpus!r} does not exist")
        check_tokenizer_spec(self.tokenizer)

    def cache_root(self) -> str:
        """The cache directory, defaulting to ~/.cache/tessera."""
        return os.path.expanduser(self.cache_dir or os.path.join("~", ".cache", "tessera"))


@dataclass
class Corpus:
    """Token splits as read-only memory maps; ``path`` is the cache directory holding them."""

    train: Union[np.ndarray, TokenStream, SFTExamples]  # uint8 bytes, a prepared folder's uint16/uint32 shards,
    val: Union[np.ndarray, TokenStream, SFTExamples]    # or its fine-tuning examples
    meta: Dict[str, object] = field(default_factory=dict)
    path: str = ""


# ---------------------------------------------------------------- gathering files


def _stat_entry(rel: str, path: str) -> SourceFile:
    st = os.stat(path)
    return (rel, path, st.st_size, st.st_mtime_ns)


def _walk(root: str, keep_file, skip_dir) -> List[SourceFile]:
    """All files under root that ``keep_file`` accepts, sorted by relative POSIX path
    so the corpus (and its cache key) is the same on every machine."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if keep_file(name) and os.path.isfile(path):
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                found.append(_stat_entry(rel, path))
    return sorted(found)


def _list_sources(corpus: str) -> Tuple[str, Dict[str, object], List[SourceFile]]:
    """Return (source description, key material, candidate files) for a corpus setting."""
    if corpus == "stdlib":
        root = os.path.realpath(sysconfig.get_paths()["stdlib"])
        files = _walk(root, lambda n: n.endswith(".py"),
                      lambda d: d in ("site-packages", "__pycache__"))
        source = f"stdlib:{root}"
        desc = {"source": source, "python": sys.version.split()[0],
                "implementation": sys.implementation.name}
    else:
        root = os.path.realpath(os.path.expanduser(corpus))
        if os.path.isdir(root):
            # Hidden folders (.git, .venv) hold tool state, not the user's text.
            files = _walk(root, lambda n: True, lambda d: d.startswith(".") or d == "__pycache__")
        else:
            files = [_stat_entry(os.path.basename(root), root)]
        source = root
        desc = {"source": source}
    if not files:
        raise ConfigError(f"corpus {corpus!r} contains no files")
    return source, desc, files


def _cache_key(desc: Dict[str, object], files: List[SourceFile], val_fraction: float) -> str:
    """Hash of everything the cached tokens depend on; any change gives a new cache."""
    material = dict(desc, format=_FORMAT, val_fraction=float(val_fraction),
                    files=[[rel, size, mtime] for rel, _, size, mtime in files])
    blob = json.dumps(material, sort_keys=True).encode("utf-8")
    return hashlib.sha1(blob).hexdigest()[:16]


# ---------------------------------------------------------------- splitting


def _split_files(rels: List[str], val_fraction: float) -> Tuple[List[str], List[str]]:
    """Per-file split so validation text is never seen in training, even partly."""
    rule = SplitRule(rels, val_fraction)
    val = [rel for rel in rels if rule.is_val(rel)]
    chosen = set(val)
    return [rel for rel in rels if rel not in chosen], val


def _tail_cut(data: bytes, val_fraction: float) -> int:
    """Byte offset where the validation tail of a single document starts."""
    cut = len(data) - max(1, int(round(len(data) * val_fraction)))
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:
        cut -= 1  # do not start validation inside a multi-byte character
    return cut


# ---------------------------------------------------------------- building the cache


def _write_split(out_dir: str, name: str, chunks: Iterator[bytes]) -> int:
    """Write documents, each followed by the end-of-text byte; return the token count."""
    n = 0
    with temp_writer(out_dir, name) as f:
        for chunk in chunks:
            f.write(chunk)
            f.write(_EOT)
            n += len(chunk) + 1
    return n


def _build(out_dir: str, source: str, files: List[SourceFile], key: str,
           val_fraction: float, progress: bool) -> Dict[str, object]:
    """Tokenize the corpus into out_dir and return its meta (already written)."""
    with tqdm(total=2 * len(files), desc="building corpus cache", unit="file",
              disable=not progress) as bar:
        # First pass only checks which files are usable, so the split (and its
        # non-empty fallbacks) is decided before anything is written.
        valid = {}
        for rel, path, _, _ in files:
            if _read_text(path) is not None:
                valid[rel] = path
            bar.update(1)
        if not valid:
            raise ConfigError(f"corpus {source!r} contains no non-empty UTF-8 text file without NUL bytes")

        if len(valid) == 1:  # one document: its tail is the validation split
            data = _read_text(next(iter(valid.values()))) or b""
            cut = _tail_cut(data, val_fraction)
            n_train = _write_split(out_dir, "train.bin", iter([data[:cut]]))
            n_val = _write_split(out_dir, "val.bin", iter([data[cut:]]))
            bar.update(len(files))
        else:
            train_rels, val_rels = _split_files(list(valid), val_fraction)

            def docs(rels: List[str]) -> Iterator[bytes]:
                for rel in rels:
                    yield _read_text(valid[rel]) or b""
                    bar.update(1)

            n_train = _write_split(out_dir, "train.bin", docs(train_rels))
            n_val = _write_split(out_dir, "val.bin", docs(val_rels))
            bar.update(len(files) - len(valid))

    meta = {"source": source, "n_files": len(valid), "n_train_tokens": n_train,
            "n_val_tokens": n_val, "dtype": "uint8", "key": key,
            "val_fraction": val_fraction, "format": _FORMAT}
    write_json(out_dir, "meta.json", meta)
    return meta


def _load_or_build(out_dir: str, source: str, files: List[SourceFile], key: str,
                   val_fraction: float, progress: bool) -> Dict[str, object]:
    return built_once(out_dir, "cache directory",
                      lambda: _build(out_dir, source, files, key, val_fraction, progress))[0]


def _prepared(cfg: DataConfig) -> Optional[Tuple[str, Dict[str, object]]]:
    """(folder, meta) when ``data.corpus`` is a folder tessera prepare wrote, its tokenizer checked (and,
    for fine-tuning data, its prompts against ``data.seq_len``)."""
    folder = os.path.expanduser(cfg.corpus)
    if cfg.corpus == "stdlib" or not is_prepared(folder):
        return None
    meta = read_prepared(folder)
    made = meta["tokenizer"]  # type: ignore[index]
    tok = ByteTokenizer() if cfg.tokenizer == "byte" else load_tokenizer(cfg.tokenizer)
    if (tok.fingerprint, tok.eot) != (made["fingerprint"], made["eot"]):
        hint = "byte" if made["fingerprint"] == "byte" else os.path.join(cfg.corpus, "tokenizer")
        raise ConfigError(f"corpus {cfg.corpus!r} was prepared with another tokenizer than "
                          f"data.tokenizer={cfg.tokenizer!r}: set --data.tokenizer={hint}")
    if meta.get("sft"):
        check_prompts_fit(meta, cfg.seq_len, cfg.corpus)
    return folder, meta


def check_vocabulary(cfg: DataConfig, vocab_size: int) -> None:
    """Refuse, before anything starts, a model whose vocabulary is smaller than the data's tokenizer's."""
    prepared = _prepared(cfg)
    if prepared is not None:
        need, what = int(prepared[1]["tokenizer"]["vocab_size"]), f"corpus {cfg.corpus!r}"  # type: ignore
    else:
        need, what = load_tokenizer(cfg.tokenizer).vocab_size, f"data.tokenizer={cfg.tokenizer!r}"
    if vocab_size < need:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the {need} token ids of {what}: "
                          f"set --model.vocab_size={need} or more")


def _token_corpus(cfg: DataConfig, folder: str, meta: Dict[str, object]) -> Corpus:
    """A prepared folder's splits, each read as one stream over its shards (fine-tuning data: examples)."""
    splits = meta["splits"]  # type: ignore[index]
    if meta.get("sft"):
        train, val = (open_sft_split(folder, meta, split) for split in ("train", "val"))
        return Corpus(train=train, val=val, meta=meta, path=folder)
    _check_lengths(cfg, {split: int(splits[split]["tokens"]) for split in ("train", "val")})
    train, val = (open_split(folder, splits[split]["shards"], split, np.dtype(str(meta["dtype"])))
                  for split in ("train", "val"))
    if cfg.bucketing != "none":  # length buckets are made of documents
        train.doc_offsets = document_offsets(folder, splits["train"]["shards"], "train")
    return Corpus(train=train, val=val, meta=meta, path=folder)  # type: ignore[arg-type]


def _check_lengths(cfg: DataConfig, tokens: Dict[str, int]) -> None:
    for split, n in tokens.items():
        if n < cfg.seq_len + 1:
            raise ConfigError(f"the {split} split of corpus {cfg.corpus!r} has {n} tokens, "
                              f"fewer than seq_len + 1 = {cfg.seq_len + 1}")


def load_corpus(cfg: DataConfig, progress: bool = False) -> Corpus:
    """Return the corpus of ``cfg`` as memory-mapped tokens, building its cache on first use.

    A folder written by ``tessera prepare`` is read as it is. Raw text with ``data.tokenizer`` a Hugging
    Face tokenizer goes through the same prepare code into ``<cache>/tokens/<key>``; with bytes (the
    default) into ``<cache>/corpus/<key>`` as uint8 ``train.bin`` / ``val.bin``."""
    cfg.validate()
    prepared = _prepared(cfg)
    if prepared is not None:
        return _token_corpus(cfg, *prepared)
    source, desc, files = _list_sources(cfg.corpus)
    if cfg.tokenizer != "byte":
        tok = load_tokenizer(cfg.tokenizer)
        key = _cache_key(dict(desc, tokenizer=tok.fingerprint, eot=tok.eot), files, cfg.val_fraction)
        out_dir = os.path.join(cfg.cache_root(), "tokens", key)
        meta = prepare(text_sources(files), out_dir, tok, val_fraction=cfg.val_fraction, progress=progress)
        return _token_corpus(cfg, out_dir, meta)
    key = _cache_key(desc, files, cfg.val_fraction)
    out_dir = os.path.join(cfg.cache_root(), "corpus", key)
    meta = _load_or_build(out_dir, source, files, key, cfg.val_fraction, progress)
    _check_lengths(cfg, {split: int(meta[f"n_{split}_tokens"]) for split in ("train", "val")})
    train = np.memmap(os.path.join(out_dir, "train.bin"), dtype=np.uint8, mode="r")
    val = np.memmap(os.path.join(out_dir, "val.bin"), dtype=np.uint8, mode="r")
    return Corpus(train=train, val=val, meta=meta, path=out_dir)
