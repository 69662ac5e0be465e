"""bf16 against fp32 step time for the 3D demo layout (`tessera train`: dp2 × tp2 × pp2, 1F1B, 8 ranks).

Both precisions run the same job through the CLI (the demo's model, data, seed and global batch), one
after the other, interleaved A B A B over ``--rounds`` rounds so a shared machine's noise hits both
alike. A run's step time is the median over its logged intervals after the first (warm-up) of
tokens per step / tokens per second. The ratio reported is the median over rounds of bf16 / fp32, with
its min–max over rounds. bf16 halves the bytes of every activation, gradient and message and adds the fp32
master copy's update; what that nets depends on the machine (its bf16 matrix units, memory bandwidth), so
it is measured, here and on a GPU with the same command.

    python benchmarks/precision.py                 # 7 rounds of 12 steps each, writes docs/BENCHMARKS.md
    python benchmarks/precision.py --rounds 1 --steps 6 --no-write
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, MIN_ROUNDS, provenance, replace_section, round_order, spread  # noqa: E402

PRECISIONS = ("fp32", "bf16")


def step_seconds(out_dir: Path, name: str, precision: str, steps: int) -> float:
    """One demo run in ``precision`` through the CLI; its median step time after warm-up."""
    args = [sys.executable, "-m", "tessera", "train", f"--precision.dtype={precision}", f"--train.steps={steps}",
            "--train.log_every=2", f"--train.eval_every={steps}", "--data.eval_batches=1",
            f"--run.out_dir={out_dir}", f"--run.name={name}", "--run.progress=false",
            "--checkpoint.save_final=false"]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    lines = [json.loads(x) for x in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"][1:]  # the first interval holds the warm-up
    batch_tokens = _tokens_per_step(out_dir / name)
    return statistics.median(batch_tokens / r["tokens_per_s"] for r in train)


def _tokens_per_step(run_dir: Path) -> int:
    import tomllib

    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    return int(cfg["data"]["global_batch_size"]) * int(cfg["data"]["seq_len"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for p in round_order(PRECISIONS, r):
                times[p].append(step_seconds(Path(tmp), f"{p}-{r}", p, args.steps))
                print(f"round {r} {p}: {times[p][-1] * 1e3:.0f} ms/step", flush=True)
    ratios = [b / f for b, f in zip(times["bf16"], times["fp32"])]
    lines = [
        "| precision | step time (median of rounds) | bf16 / fp32 (median (min–max) over rounds) |",
        "|---|---|---|",
        f"| fp32 | {statistics.median(times['fp32']) * 1e3:.0f} ms | |",
        f"| bf16 (fp32 master weights) | {statistics.median(times['bf16']) * 1e3:.0f} ms | {spread(ratios, 2)} |",
        "",
        f"{provenance()} {args.rounds} interleaved rounds (the order alternates every round) of {args.steps} "
        "steps, the demo layout (dp2 × tp2 × pp2, 1F1B, 8 ranks, `small` preset).",
    ]
    print("\n".join(lines))
    if not args.no_write:
        replace_section(DOCS / "BENCHMARKS.md", "precision", "bf16 against fp32: the 3D demo layout (CPU, gloo)",
                        lines)


if __name__ == "__main__":
    main()
