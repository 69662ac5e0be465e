"""Asynchronous data parallelism for the transformer: sync vs SSP vs async at 2 ranks on the default corpus.

Each run is one `tessera train` job through the CLI (same preset, seed, data and global batch):

- ``sync``: DDP (`ddp.mode=allreduce`), the reference;
- ``ssp``: a parameter server sharded over both ranks, bounded staleness s (`ddp.mode=ps-sharded
  --ddp.consistency=ssp --ddp.staleness=S`);
- ``async``: a parameter server on rank 0, every push applied on arrival (`ddp.mode=ps-rank0
  --ddp.consistency=async`).

Reported per run: the final validation loss (the servers' parameters, on the fixed validation batches),
steps/s (steps ÷ the job's training seconds, validation included), and the staleness of the pushes applied
(max and mean, from summary.json). The margin the asynchronous runs must land within is stated before the
run (MARGIN, in nats of validation loss) and checked: the script exits 1 when a run misses it.

    python benchmarks/async_dp.py                       # writes the table into docs/PARAMETER_SERVER.md
    python benchmarks/async_dp.py --steps 20 --no-write  # quick check
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, provenance, replace_section  # noqa: E402

MARGIN = 0.10  # nats: val loss (async or ssp) may exceed val loss (sync) by this much after the same steps


def runs(staleness: int) -> dict[str, list[str]]:
    return {
        "sync": [],
        "ssp": ["--ddp.mode=ps-sharded", "--ddp.consistency=ssp", f"--ddp.staleness={staleness}"],
        "async": ["--ddp.mode=ps-rank0", "--ddp.consistency=async"],
    }


def run(name: str, extra: list[str], out_dir: Path, args) -> dict:
    """One 2-rank job through the CLI; its summary.json."""
    cmd = [sys.executable, "-m", "tessera", "train", "--nproc", "2", f"--model.preset={args.preset}",
           f"--train.steps={args.steps}", f"--train.eval_every={args.steps}", f"--train.log_every={args.steps}",
           f"--run.out_dir={out_dir}", f"--run.name={name}", "--run.progress=false",
           "--checkpoint.save_final=false", *extra]
    subprocess.run(cmd, check=True)
    return json.loads((out_dir / name / "summary.json").read_text())


def table(results: dict[str, dict], steps: int) -> list[str]:
    sync = results["sync"]["val_loss_end"]
    lines = ["| run | val loss | vs sync | steps/s | staleness max | staleness mean |",
             "|---|---|---|---|---|---|"]
    for name, s in results.items():
        stale = ("–", "–") if "staleness_max" not in s else (str(s["staleness_max"]), f"{s['staleness_mean']:.2f}")
        lines.append(f"| {name} | {s['val_loss_end']:.4f} | {s['val_loss_end'] - sync:+.4f} | "
                     f"{steps / s['seconds']:.2f} | {stale[0]} | {stale[1]} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/PARAMETER_SERVER.md alone")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tessera-async-dp-") as tmp:
        results = {name: run(name, extra, Path(tmp), args) for name, extra in runs(args.staleness).items()}
    lines = [f"The `{args.preset}` preset for {args.steps} steps at 2 ranks on the default corpus, ssp with "
             f"s = {args.staleness}; margin stated before the run: {MARGIN} nats of validation loss "
             f"({time.perf_counter() - start:.0f} s in all).", "", *table(results, args.steps), "", provenance()]
    print("\n".join(lines))
    if not args.no_write:
        replace_section(DOCS / "PARAMETER_SERVER.md", "async_dp", "Asynchronous transformer: convergence", lines)
    sync = results["sync"]["val_loss_end"]
    missed = [n for n in ("ssp", "async") if results[n]["val_loss_end"] - sync > MARGIN]
    if missed:
        raise SystemExit(f"{', '.join(missed)} missed the synchronous validation loss by more than {MARGIN} nats")


if __name__ == "__main__":
    main()
