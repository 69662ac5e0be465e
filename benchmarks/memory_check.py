"""Predicted against measured peak memory per rank: the memory check's prediction (tessera.train.memory_check:
the planner's bytes, what ``--dry-run`` prints, plus a process's fixed cost) next to the peak resident memory
each rank really reached, for a few small jobs on local CPU ranks.

Each job runs as ``tessera train`` in a subprocess; this script samples ``/proc`` of every process below it
every 0.1 s and keeps, per rank (a process the elastic agent spawned), the kernel's high-water
mark of its resident set (``VmHWM``), so the peak is exact however short it was. The trainer's own
``peak memory`` (``ru_maxrss`` at its last memory snapshot, in summary.json) is shown beside it.

    python benchmarks/memory_check.py                      # every job, table into docs/PLANNER.md
    python benchmarks/memory_check.py --no-write --jobs tiny-z0-fp32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, provenance, replace_section  # noqa: E402
from _procs import descendants, is_rank, sample  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ONE_B = ["--model.preset=1B", "--model.vocab_size=256", "--data.seq_len=64", "--data.global_batch_size=2",
         "--data.micro_batch_size=1"]
JOBS = {  # name -> flags (2 local ranks unless NPROC says otherwise, 2 steps); each under about 2 GB per rank
    "tiny-z0-fp32": ["--model.preset=tiny"],
    "1B/1-z0-fp32": [*ONE_B, "--model.n_layers=1"],
    "1B/2-z3-fp32": [*ONE_B, "--model.n_layers=2", "--parallel.zero_stage=3"],
    "1B/2-z3-bf16": [*ONE_B, "--model.n_layers=2", "--parallel.zero_stage=3", "--precision.dtype=bf16"],
    "1B/2-z1-bf16": [*ONE_B, "--model.n_layers=2", "--parallel.zero_stage=1", "--precision.dtype=bf16"],
    # issue 16's target: 0.49B parameters (whole fp32 model 1.95 GB) on 8 ranks, no rank ever holding all of it
    "1B/8-z3-bf16-x8": ["--model.preset=1B", "--model.vocab_size=256", "--data.seq_len=64",
                        "--data.global_batch_size=8", "--data.micro_batch_size=1", "--model.n_layers=8",
                        "--parallel.zero_stage=3", "--precision.dtype=bf16"],
}
NPROC = {"1B/8-z3-bf16-x8": 8}  # local ranks of a job, when not 2
COMMON = ["--train.steps=2", "--run.progress=false", "--checkpoint.save_final=false"]
GB = 1e9


def measure(flags: list[str], nproc: int, out_dir: str) -> tuple[dict, dict]:
    """Run one job; ({rank process id: peak resident bytes, from /proc}, its summary.json)."""
    cmd = [sys.executable, "-m", "tessera", "train", "--nproc", str(nproc), *COMMON, *flags, f"--run.out_dir={out_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            if is_rank(pid):
                peaks[pid] = max(peaks.get(pid, 0), (sample(pid) or {"hwm": 0})["hwm"])
        time.sleep(0.1)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.strip()[-2000:]}")
    summary = json.loads(Path(json.loads(out)["run_dir"], "summary.json").read_text())
    return peaks, summary


def predict(flags: list[str], nproc: int) -> tuple[float, dict]:
    """The memory check's predicted peak of a rank, and the planner's bytes by kind (busiest stage)."""
    from tessera.cli import resolve_job
    from tessera.train.config import load_config
    from tessera.train.dry_run import predicted_memory
    from tessera.train.memory_check import predicted_peak

    cfg = load_config(None, [*flags, f"--run.nproc={nproc}"])
    par = resolve_job(cfg, nproc, announce=False)
    return predicted_peak(cfg, par), max(predicted_memory(cfg, par)[0], key=lambda m: m["total"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated names of " + ", ".join(JOBS))
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/PLANNER.md alone")
    args = parser.parse_args()
    rows = ["| job | ranks | flags (2 steps) | planner: states / activations / buffers (GB) | predicted peak (GB) "
            "| measured peak RSS, max over ranks (GB) | err | trainer's peak memory (GB) |", "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.jobs.split(","):
            flags, nproc = JOBS[name], NPROC.get(name, 2)
            need, parts = predict(flags, nproc)
            peaks, summary = measure(flags, nproc, tmp)
            measured = max(peaks.values())
            trainer = max(r["peak_rss"] for r in summary["memory_per_rank"])
            states = parts["params"] + parts["grads"] + parts["optimizer"]
            rows.append(f"| {name} | {nproc} | `{' '.join(flags)}` | {states / GB:.3f} / {parts['activations'] / GB:.3f} / "
                        f"{parts['buffers'] / GB:.3f} | {need / GB:.2f} | {measured / GB:.2f} | "
                        f"{(need - measured) / measured:+.0%} | {trainer / GB:.2f} |")
            print(rows[-1], flush=True)
    lines = [f"{provenance()} {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GB:.1f} GB RAM.", "",
             *rows]
    if not args.no_write:
        replace_section(DOCS / "PLANNER.md", "memory-check", "Predicted against measured peak memory", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
