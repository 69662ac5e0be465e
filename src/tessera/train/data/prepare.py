"""Tokenise documents into token shards: the one engine behind ``tessera prepare`` and behind training's
token cache for a raw-text corpus with a ``data.tokenizer`` folder.

A prepared folder holds the shards of ``train`` and ``val`` (:mod:`tessera.train.data.shards`), a copy of
the Hugging Face tokenizer's files in ``tokenizer/`` (none for bytes), and ``meta.json``, written last:

    format, version   "tessera-tokens", 1
    dtype             "uint16" when the vocabulary fits 65536 ids, else "uint32"
    tokenizer         fingerprint, vocab_size, eot
    splits            per split: tokens, documents, shards [{index, tokens, documents}]
    sources           name, path, bytes, mtime_ns of every input file
    val_fraction, text_field, shard_tokens, skipped_documents, key
    sft               (fine-tuning data only) {prompt, response}: the JSON fields of each example; each
                      split then also counts its prompt_tokens and longest_prompt (:mod:`tessera.train.data.sft`)

Guarantees: documents are read in input order and each goes whole to one split by a hash of its key
(:class:`~tessera.train.data.documents.SplitRule`); a single document's last ``val_fraction`` of tokens is
its validation split instead. The same inputs and settings give the same bytes. An interrupted run leaves
finished shards and a ``.prepare.json`` (what is being made); run again, it keeps those shards, skips their
documents without tokenising them, and writes exactly the bytes an uninterrupted run writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Dict, List, Optional, Sequence

import numpy as np
from tqdm import tqdm

from tessera.errors import ConfigError
from tessera.train.data.documents import Source, SplitRule, document_keys, documents
from tessera.train.data.files import built_once, read_json, write_json
from tessera.train.data.sft import SFTFields, check_sources, encode_examples, examples
from tessera.train.data.shards import ShardWriter, finished_shards, prompt_lengths, remove_shards_from
from tessera.train.data.tokenizer import HFTokenizer, Tokenizer, token_dtype

FORMAT, VERSION = "tessera-tokens", 1
DEFAULT_SHARD_TOKENS = 100_000_000
PLAN = ".prepare.json"  # an unfinished prepare's settings; a rerun with the same ones resumes
SPLITS = ("train", "val")
_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 22  # documents handed to the tokenizer at once


def _plan(sources: Sequence[Source], tokenizer: Tokenizer, val_fraction: float, text_field: str,
          shard_tokens: int, sft: Optional[SFTFields]) -> Dict[str, object]:
    """Everything the shards' bytes depend on; ``key`` hashes it (``sft`` only when set, so the key of a
    plain corpus is what it always was)."""
    plan = {"format": FORMAT, "version": VERSION, "dtype": token_dtype(tokenizer.vocab_size).name,
            "tokenizer": {"fingerprint": tokenizer.fingerprint, "vocab_size": int(tokenizer.vocab_size),
                          "eot": int(tokenizer.eot)},
            "val_fraction": float(val_fraction), "text_field": text_field, "shard_tokens": int(shard_tokens),
            "sources": [{"name": s.rel, "path": s.path, "bytes": s.size, "mtime_ns": s.mtime_ns}
                        for s in sources]}
    if sft is not None:
        plan["sft"] = sft.as_dict()
    plan["key"] = hashlib.sha1(json.dumps(plan, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    return plan


def check_settings(val_fraction: float, text_field: str, shard_tokens: int) -> None:
    if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction <= 0.5:
        raise ConfigError(f"the validation fraction must be in (0, 0.5], got {val_fraction!r}")
    if not isinstance(text_field, str) or not text_field:
        raise ConfigError(f"the text field must be a non-empty name, got {text_field!r}")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ConfigError(f"tokens per shard must be a positive integer, got {shard_tokens!r}")


def prepare(sources: Sequence[Source], out_dir: str, tokenizer: Tokenizer, *, val_fraction: float = 0.02,
            text_field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS, sft: Optional[SFTFields] = None,
            progress: bool = False) -> Dict[str, object]:
    """Tokenise ``sources`` into ``out_dir`` (or resume an interrupted run there) and return its meta.
    With ``sft`` the sources are JSON lines of prompt/response pairs (:mod:`tessera.train.data.sft`)."""
    check_settings(val_fraction, text_field, shard_tokens)
    if sft is not None:
        sft.check()
        check_sources(sources)
    plan = _plan(sources, tokenizer, val_fraction, text_field, shard_tokens, sft)

    def build() -> Dict[str, object]:
        _claim(out_dir, plan)
        return _build(sources, out_dir, tokenizer, plan, progress)

    meta, built = built_once(out_dir, "folder", build)
    return meta if built else _already(meta, plan, out_dir)


def _already(meta: Dict[str, object], plan: Dict[str, object], out_dir: str) -> Dict[str, object]:
    if meta.get("key") != plan["key"]:
        raise ConfigError(f"{out_dir} already holds a corpus prepared from other inputs or settings; "
                          f"remove it or choose another output folder")
    return meta


def _claim(out_dir: str, plan: Dict[str, object]) -> None:
    """Make ``out_dir`` this plan's: resume our own unfinished run, restart a stale one of other settings,
    and refuse a folder holding anything else."""
    old = read_json(out_dir, PLAN)
    if old is None:
        if any(name != ".lock" for name in os.listdir(out_dir)):
            raise ConfigError(f"{out_dir} is not empty and holds no unfinished tessera prepare; "
                              f"choose a new or empty output folder")
    elif old.get("key") != plan["key"]:  # inputs or settings changed since: its shards are stale
        remove_shards_from(out_dir, {split: 0 for split in SPLITS})
        shutil.rmtree(os.path.join(out_dir, "tokenizer"), ignore_errors=True)
    write_json(out_dir, PLAN, plan)


def _scan(sources: Sequence[Source], plan: Dict[str, object], progress: bool) -> SplitRule:
    """First pass: every document key (no text read), for the split's fallbacks and the progress total."""
    def keys():
        for src in tqdm(sources, desc="listing documents", unit="file", disable=not progress):
            yield from document_keys(src, str(plan["text_field"]))

    return SplitRule(keys(), float(plan["val_fraction"]))  # type: ignore[arg-type]


def _build(sources: Sequence[Source], out_dir: str, tokenizer: Tokenizer, plan: Dict[str, object],
           progress: bool) -> Dict[str, object]:
    dtype, sft = np.dtype(str(plan["dtype"])), "sft" in plan
    rule = _scan(sources, plan, progress)
    if sft and rule.n_keys < 2:
        raise ConfigError("fine-tuning data needs at least two examples, one for each of train and val")
    done = {split: finished_shards(out_dir, split, dtype, sft) for split in SPLITS}
    remove_shards_from(out_dir, {split: len(done[split]) for split in SPLITS})  # torn and temp files
    if progress and any(done.values()):
        tqdm.write(f"resuming: {sum(map(len, done.values()))} finished shards kept in {out_dir}")
    writers = {split: ShardWriter(out_dir, split, dtype, int(plan["shard_tokens"]), len(done[split]), sft)
               for split in SPLITS}  # type: ignore[arg-type]
    if rule.n_keys == 1:
        skipped = _write_single(sources, tokenizer, writers, done, plan)
    else:
        skip = {split: sum(s["documents"] for s in done[split]) for split in SPLITS}
        skipped = _write_documents(sources, rule, tokenizer, writers, skip, plan, progress)
    for writer in writers.values():
        writer.flush()
    splits = {}
    for split in SPLITS:
        shards = finished_shards(out_dir, split, dtype, sft)
        if not shards:
            raise ConfigError(f"the {split} split is empty: the inputs need at least two non-empty documents "
                              f"(or one of at least two tokens)")
        splits[split] = {"tokens": sum(s["tokens"] for s in shards),
                         "documents": sum(s["documents"] for s in shards), "shards": shards}
        if sft:
            prompts = prompt_lengths(out_dir, shards, split)
            splits[split].update(prompt_tokens=int(prompts.sum()), longest_prompt=int(prompts.max()))
    _copy_tokenizer(tokenizer, out_dir)
    meta = dict(plan, splits=splits, skipped_documents=skipped)
    write_json(out_dir, "meta.json", meta)  # last: marks the folder complete
    os.unlink(os.path.join(out_dir, PLAN))
    return meta


def _write_documents(sources: Sequence[Source], rule: SplitRule, tokenizer: Tokenizer,
                     writers: Dict[str, ShardWriter], skip: Dict[str, int], plan: Dict[str, object],
                     progress: bool) -> int:
    """Second pass: tokenise every document not in a finished shard; returns how many were skipped."""
    read, encode = _reader(plan)
    pending: List[tuple] = []  # (split, key, text or (prompt, response)) waiting for one batched encode
    chars = skipped = 0
    with tqdm(total=rule.n_keys, desc="tokenising", unit="doc", disable=not progress) as bar:
        for src in sources:
            for key, text in read(src):
                bar.update(1)
                if text is None:
                    skipped += 1
                    continue
                split = "val" if rule.is_val(key) else "train"
                if skip[split]:  # already in a finished shard of a previous run
                    skip[split] -= 1
                    continue
                pending.append((split, key, text))
                chars += len(text) if isinstance(text, str) else sum(map(len, text))
                if len(pending) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                    encode(pending, tokenizer, writers)
                    pending, chars = [], 0
        encode(pending, tokenizer, writers)
    return skipped


def _reader(plan: Dict[str, object]):
    """(documents of a source, batch encoder) of the plan's kind: texts, or prompt/response examples."""
    if "sft" in plan:
        fields = SFTFields(**plan["sft"])  # type: ignore[arg-type]
        return (lambda src: examples(src, fields)), encode_examples
    text_field = str(plan["text_field"])
    return (lambda src: documents(src, text_field)), _encode_into


def _encode_into(pending: List[tuple], tokenizer: Tokenizer, writers: Dict[str, ShardWriter]) -> None:
    if not pending:
        return
    for (split, _, _), ids in zip(pending, tokenizer.encode_batch([text for _, _, text in pending])):
        writers[split].add(ids, tokenizer.eot)


def _write_single(sources: Sequence[Source], tokenizer: Tokenizer, writers: Dict[str, ShardWriter],
                  done: Dict[str, list], plan: Dict[str, object]) -> int:
    """One document: its last ``val_fraction`` of tokens (at least one) is the validation split."""
    (_, text), = [doc for src in sources for doc in documents(src, str(plan["text_field"]))]
    if text is None:
        return 1
    ids = tokenizer.encode_batch([text])[0]
    cut = len(ids) - max(1, int(round(len(ids) * float(plan["val_fraction"]))))  # type: ignore[arg-type]
    if cut < 1:
        return 0  # too short to split: reported as an empty split
    for split, part in (("train", ids[:cut]), ("val", ids[cut:])):
        if not done[split]:
            writers[split].add(part, tokenizer.eot)
    return 0


def _copy_tokenizer(tokenizer: Tokenizer, out_dir: str) -> None:
    """A Hugging Face tokenizer's files go with the tokens: ``--data.tokenizer=<out_dir>/tokenizer``."""
    if not isinstance(tokenizer, HFTokenizer):
        return
    tokenizer.copy_files(os.path.join(out_dir, "tokenizer"))


def read_prepared(folder: str) -> Dict[str, object]:
    """The meta of a complete prepared folder; refuses one of another format or version."""
    meta = read_json(folder, "meta.json")
    if meta is None or meta.get("format") != FORMAT:
        raise ConfigError(f"{folder} is not a folder written by tessera prepare (no meta.json of its format)")
    if meta.get("version") != VERSION:
        raise ConfigError(f"{folder} was prepared in format version {meta.get('version')}, this tessera reads "
                          f"version {VERSION}: prepare it again")
    return meta


def is_prepared(path: str) -> bool:
    """Whether ``path`` is a folder whose meta.json says tessera prepare wrote it."""
    try:
        meta = read_json(path, "meta.json") if os.path.isdir(path) else None
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT
