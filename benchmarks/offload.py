"""Disk offload of ZeRO's fp32 master weights and AdamW state: train a model whose training state does not
fit in this machine's memory, and record each rank's peak resident memory, the disk bytes of a step, the
step time and the loss.

Runs ``tessera train`` (ZeRO-3, bf16, ``zero.offload=disk``) in a subprocess and samples ``/proc`` of every
rank process (a process below it started by multiprocessing's spawn) every 0.2 s: the kernel's high-water
mark of its resident set (``VmHWM``, exact however short the peak) and its storage I/O (``read_bytes`` /
``write_bytes`` of ``/proc/<pid>/io``: bytes that really went to or came from the disk, page-cache hits
excluded). A step's numbers are the differences between the moments rank 0 logs two consecutive training
steps (``train.log_every=1``). The streamed bytes (what the optimizer moved between its files and RAM,
page cache or not) are 12 B per master element each way.

    python benchmarks/offload.py                                   # the 7B preset, 8 layers: docs/BENCHMARKS.md
    python benchmarks/offload.py --preset small --layers 2 --no-write   # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, provenance, replace_section  # noqa: E402
from _procs import descendants, is_rank, sample  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def train_flags(args) -> list[str]:
    return ["--nproc", str(args.nproc), f"--model.preset={args.preset}", f"--model.n_layers={args.layers}",
            f"--model.vocab_size={args.vocab}", "--parallel.zero_stage=3", "--precision.dtype=bf16",
            f"--zero.offload={args.offload}", *([f"--zero.offload_chunk_mb={args.chunk_mb}"] if args.offload == "disk"
                                               else []), f"--data.seq_len={args.seq}",
            f"--data.global_batch_size={args.nproc}", "--data.micro_batch_size=1", f"--train.steps={args.steps}"]


RUN_FLAGS = ["--train.log_every=1", "--data.eval_batches=1", "--run.progress=false",
             "--checkpoint.save_final=false"]


def _train_lines(run_dirs: list[Path]) -> list[dict]:
    for run in run_dirs:
        path = run / "metrics.jsonl"
        if path.exists():
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            return [x for x in lines if x["kind"] == "train"]
    return []


def measure(flags: list[str], out_dir: Path) -> dict:
    """Run the job; per rank process its peak resident bytes, and the rank processes' I/O counters (summed)
    and the time at the moment each training step was logged."""
    cmd = [sys.executable, "-m", "tessera", "train", *flags, *RUN_FLAGS, f"--run.out_dir={out_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks, last, marks, started = {}, {}, [], time.perf_counter()
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            if is_rank(pid) and (s := sample(pid)) is not None:
                peaks[pid], last[pid] = max(peaks.get(pid, 0), s["hwm"]), s
        logged = _train_lines(sorted(out_dir.glob("*")))
        if len(logged) > len(marks):  # a step was logged since the last sample
            io = {k: sum(s[k] for s in last.values()) for k in ("read", "write")}
            marks += [{"step": x["step"], "seconds": time.perf_counter() - started, **io}
                      for x in logged[len(marks):]]
        time.sleep(0.2)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.strip()[-2000:]}")
    summary = json.loads(Path(json.loads(out)["run_dir"], "summary.json").read_text())
    return {"peaks": sorted(peaks.values()), "marks": marks, "summary": summary,
            "lines": _train_lines([Path(summary["run_dir"])])}


def without_offload(args, out_dir: Path) -> dict:
    """The same job with the state in RAM (``zero.offload=none``): the memory check before launch must refuse
    it (exit 2, one sentence, before any rank starts)."""
    flags = [f for f in train_flags(args) if not f.startswith(("--zero.offload", "--zero.offload_chunk_mb"))]
    cmd = [sys.executable, "-m", "tessera", "train", *flags, "--zero.offload=none", *RUN_FLAGS,
           f"--run.out_dir={out_dir}"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:  # a refusal comes within seconds; a job that launched instead is stopped with its ranks, not trained
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"code": None, "message": "launched: not refused within 120 s (stopped)",
                "seconds": time.perf_counter() - started}
    return {"code": proc.returncode, "message": err.strip().splitlines()[-1] if err.strip() else "",
            "seconds": time.perf_counter() - started}


def report(args, result: dict, offload_dir: Path) -> list[str]:
    summary, marks, lines = result["summary"], result["marks"], result["lines"]
    params = summary["parameters"]
    streamed = 12 * params / args.nproc  # each way, per rank: fp32 master + exp_avg + exp_avg_sq
    rows = ["| quantity | value |", "|---|---|",
            f"| parameters | {params / 1e6:,.0f}M (fp32 masters + Adam state: {12 * params / GB:.2f} GB, "
            f"`zero.offload={args.offload}`) |",
            "| peak resident memory per rank (VmHWM) | "
            + ", ".join(f"{p / GB:.2f} GB" for p in result["peaks"]) + " |",
            "| trainer's peak memory per rank | "
            + ", ".join(f"{r['peak_rss'] / GB:.2f} GB" for r in summary["memory_per_rank"]) + " |",
            f"| streamed per step per rank | {streamed / GB:.2f} GB read, {streamed / GB:.2f} GB written |"]
    for a, b in zip(marks, marks[1:]):  # a step's interval: from the previous step's log line to its own
        rows.append(f"| step {b['step']}: disk I/O (all ranks) | {(b['read'] - a['read']) / GB:.2f} GB read, "
                    f"{(b['write'] - a['write']) / GB:.2f} GB written |")
        rows.append(f"| step {b['step']}: time | {b['seconds'] - a['seconds']:.1f} s |")
    rows.append("| training loss per step | " + ", ".join(f"{x['loss']:.4f}" for x in lines) + " |")
    rows.append(f"| validation loss, start → end | {summary['val_loss_start']:.4f} → {summary['val_loss_end']:.4f} |")
    if "refused" in result:
        r = result["refused"]
        rows.append(f"| the same job with `zero.offload=none` | exit {r['code']} after {r['seconds']:.1f} s: "
                    f"{r['message'].replace('|', '/')} |")
    usage = shutil.disk_usage(offload_dir)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    # the flags without the command's name: the docs test dry-runs every `tessera ...` span of docs/*.md, and
    # this one's free-space check would refuse a CI disk with less room than the 7B model's state
    return [f"{provenance()} Flags of tessera train: `{' '.join(train_flags(args))}` (plus "
            f"`{' '.join(RUN_FLAGS)}`); {ram:.1f} GB RAM; offload folder on a disk with {usage.total / GB:.0f} GB "
            f"({usage.free / GB:.0f} GB free after the run).", "", *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="7B")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunk-mb", type=float, default=16.0)
    parser.add_argument("--offload", choices=("disk", "host", "none"), default="disk",
                        help="the same run with the state elsewhere, for comparison (then --no-write)")
    parser.add_argument("--out-dir", default=None, help="where the run and its offload folder go (default: a "
                                                        "temporary folder in the working directory)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    # the offload files go on the disk of the working directory (not /tmp, which may be memory)
    out = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="offload-bench-", dir="."))
    try:
        # in a folder of its own: a job small enough to start (not refused) leaves a run folder there, whose
        # metrics the measured run's step marks must not be read from
        refused = without_offload(args, out / "without-offload") if args.offload == "disk" else None
        result = measure(train_flags(args), out)
        if refused is not None:
            result["refused"] = refused
        lines = report(args, result, out)
    finally:
        if not args.out_dir:
            shutil.rmtree(out, ignore_errors=True)
    if not args.no_write:
        replace_section(DOCS / "BENCHMARKS.md", "offload", "Disk offload (ZeRO-Infinity style)", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
