"""``tessera prepare``: tokenise text files, JSON lines or parquet into token shards training reads.

    tessera prepare INPUT... --out DIR [--tokenizer byte|TOKDIR] [--val-fraction F] [--text-field NAME]
                    [--shard-tokens N] [--sft [--prompt-field NAME] [--response-field NAME]]

The work is :func:`tessera.train.data.prepare.prepare`'s; this module parses, checks and reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tessera.errors import UserError
from tessera.train.data.prepare import DEFAULT_SHARD_TOKENS

DESCRIPTION = """Tokenise documents into memory-mapped token shards: a .txt file is one document, a .jsonl
file one per line (its text under --text-field), a .parquet file one per row of the --text-field column;
folders are walked in sorted order. Documents go whole to train or val by a hash of their name, each
followed by the tokenizer's end-of-document token. Interrupted, the same command resumes where it stopped.
Train on the result with --data.corpus=DIR (and --data.tokenizer=DIR/tokenizer for a Hugging Face one).
With --sft the inputs are JSON lines of prompt/response pairs for supervised fine-tuning: each line is one
example, trained one per window, and the loss counts its response tokens only."""


def add_prepare_parser(sub) -> None:
    prepare = sub.add_parser("prepare", allow_abbrev=False, description=DESCRIPTION,
                             help="tokenise text, JSON lines or parquet into token shards for training")
    prepare.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders of .txt, .jsonl, .parquet")
    prepare.add_argument("--out", required=True, help="the folder to write (new or empty, or an interrupted "
                         "prepare of the same inputs to resume)")
    prepare.add_argument("--tokenizer", default="byte", help="'byte' (default) or a folder holding a Hugging "
                         "Face tokenizer.json")
    prepare.add_argument("--val-fraction", type=float, default=0.02, help="share of documents held out for "
                         "validation, in (0, 0.5] (default 0.02)")
    prepare.add_argument("--text-field", default=None, help="the JSON field or parquet column holding the "
                         "text (default 'text')")
    prepare.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="close a shard once "
                         f"it holds this many tokens, at a document's end (default {DEFAULT_SHARD_TOKENS})")
    prepare.add_argument("--sft", action="store_true", help="the inputs are .jsonl prompt/response pairs for "
                         "supervised fine-tuning: the loss counts response tokens only")
    prepare.add_argument("--prompt-field", default=None, help="with --sft: the JSON field holding the prompt "
                         "(default 'prompt')")
    prepare.add_argument("--response-field", default=None, help="with --sft: the JSON field holding the "
                         "response (default 'response')")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bars")


def cmd_prepare(args: argparse.Namespace) -> int:
    """Check everything a user gives before tokenising anything, then prepare and print a summary."""
    from tessera.train.data.documents import find_sources
    from tessera.train.data.prepare import check_settings, prepare
    from tessera.train.data.tokenizer import load_tokenizer

    sft = _sft_fields(args)
    text_field = args.text_field or "text"
    check_settings(args.val_fraction, text_field, args.shard_tokens)
    tokenizer = load_tokenizer(args.tokenizer)
    sources = find_sources(args.inputs)
    out = os.path.abspath(os.path.expanduser(args.out))
    try:
        meta = prepare(sources, out, tokenizer, val_fraction=args.val_fraction, text_field=text_field,
                       shard_tokens=args.shard_tokens, sft=sft, progress=not args.no_progress)
    except OSError as e:  # an unreadable input, a full disk: one sentence, and the finished shards are kept
        raise UserError(f"tessera prepare could not read or write {e.filename or out} ({e.strerror}); "
                        f"the same command resumes once that is fixed") from e
    except KeyboardInterrupt:
        print(f"tessera: the same command resumes where it stopped (finished shards are kept in {out})",
              file=sys.stderr)
        raise
    splits = meta["splits"]
    summary = {"out": out, "dtype": meta["dtype"], "vocab_size": meta["tokenizer"]["vocab_size"],
               "eot": meta["tokenizer"]["eot"], "files": len(sources),
               "skipped_documents": meta["skipped_documents"],
               **{f"{split}_{what}": splits[split][what] for split in ("train", "val")
                  for what in ("documents", "tokens")},
               "shards": sum(len(splits[split]["shards"]) for split in ("train", "val"))}
    if sft is not None:  # tokens the loss counts: each example's response and its eot
        summary.update({f"{split}_response_tokens": splits[split]["tokens"] - splits[split]["prompt_tokens"]
                        for split in ("train", "val")})
    print(json.dumps(summary, indent=2))
    return 0


def _sft_fields(args: argparse.Namespace):
    """The prompt/response fields with --sft (None without it); a field named without --sft is refused."""
    from tessera.train.data.sft import SFTFields

    if not args.sft:
        if args.prompt_field is not None or args.response_field is not None:
            raise UserError("--prompt-field and --response-field name the fields of --sft data: add --sft")
        return None
    if args.text_field is not None:
        raise UserError("--text-field names the text of plain documents; --sft data has --prompt-field and "
                        "--response-field instead")
    fields = SFTFields(prompt=args.prompt_field or "prompt", response=args.response_field or "response")
    fields.check()
    return fields
