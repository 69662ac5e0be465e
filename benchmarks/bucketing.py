"""Fixed windows against length buckets on fine-tuning examples of mixed lengths: padding and real tokens/s.

A prompt/response set is built here (no download): prompts of 8-40 bytes and responses of 1-500 bytes cut
from the standard library's source, prepared with ``tessera prepare --sft`` (byte tokenizer) into a
temporary folder. Each round trains the same job twice in this process, interleaved: ``data.bucketing=none``
(one example per ``seq_len`` window, padded) and ``data.bucketing=length``. Reported per variant: the
padding fraction (padded target positions ÷ all, the train lines' ``padding_fraction``) and real tokens/s
(counted targets only: response tokens and their end ids, the summary's ``tokens_per_s_mean``), as the
median (min–max) over rounds, and the per-round speed-up.

    python benchmarks/bucketing.py                        # 7 rounds, table into docs/DATA.md
    python benchmarks/bucketing.py --rounds 1 --steps 3 --no-write
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, MIN_ROUNDS, provenance, replace_section, spread  # noqa: E402


def build_examples(folder: Path, n: int, seed: int = 0) -> Path:
    """``n`` prompt/response pairs of real text (responses of very different lengths), prepared for SFT."""
    from tessera.train.data import ByteTokenizer
    from tessera.train.data.documents import find_sources
    from tessera.train.data.prepare import prepare
    from tessera.train.data.sft import SFTFields

    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        a, b = rng.randrange(len(text) - 600), rng.randrange(len(text) - 600)
        lines.append(json.dumps({"prompt": f"Q{i}: " + text[a:a + rng.randrange(8, 40)],
                                 "response": text[b:b + int(rng.paretovariate(1.2) * 20) % 500 + 1]}))
    src = folder / "pairs.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prepare(find_sources([str(src)]), str(folder / "sft"), ByteTokenizer(), sft=SFTFields(), val_fraction=0.05)
    return folder / "sft"


def run(data: Path, out: Path, name: str, bucketing: str, args) -> tuple[float, float]:
    """(mean padding fraction, mean real tokens/s) of one training run."""
    from tessera.launch import run_rank
    from tessera.train.config import load_config

    flags = [f"--model.preset={args.preset}", f"--model.max_seq_len={args.seq}", f"--data.corpus={data}",
             f"--data.seq_len={args.seq}",
             f"--data.global_batch_size={args.batch}", f"--data.micro_batch_size={args.batch}",
             "--data.eval_batches=1", f"--train.steps={args.steps}", "--train.log_every=1",
             f"--train.eval_every={args.steps}", "--run.progress=false", "--checkpoint.save_final=false",
             f"--run.out_dir={out}", f"--run.name={name}", f"--data.bucketing={bucketing}"]
    summary = run_rank(load_config(None, flags))
    lines = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    pads = [r["padding_fraction"] for r in lines if r["kind"] == "train"][1:]  # step 0 warms up
    return sum(pads) / len(pads), summary["tokens_per_s_mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/DATA.md alone")
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"none": [], "length": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = build_examples(Path(tmp), args.examples)
        for r in range(args.rounds):
            for variant in results:  # interleaved, so a shared machine's noise hits both alike
                results[variant].append(run(data, Path(tmp) / "runs", f"{variant}-{r}", variant, args))
                print(variant, r, results[variant][-1], flush=True)
    speedup = [b[1] / a[1] for a, b in zip(results["none"], results["length"])]
    rows = ["| data.bucketing | padding fraction | real tokens/s |", "|---|---|---|"]
    for variant, got in results.items():
        rows.append(f"| `{variant}` | {spread([p for p, _ in got])} | {spread([t for _, t in got], 0)} |")
    lines = [*rows, "", f"Length buckets / fixed windows, real tokens/s per round: {spread(speedup, 2)}. "
             f"{args.rounds} rounds of {args.steps} steps, preset `{args.preset}`, seq_len {args.seq}, "
             f"batch {args.batch}. {provenance()}"]
    print("\n".join(lines))
    if not args.no_write:
        replace_section(DOCS / "DATA.md", "bucketing", "Sequence-length bucketing", lines)


if __name__ == "__main__":
    main()
