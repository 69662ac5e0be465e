"""Model-state bytes per rank of LoRA against full fine-tuning of the same model and layout, predicted by the
planner and measured by the trainer's memory ledger, with each rank's peak resident memory.

Each job runs ``tessera train`` for 2 steps in a subprocess (1 process, dp2 ZeRO-2, dp2 ZeRO-3 and tp2),
once with LoRA and once without. Predicted: the planner's model states of the job's busiest rank
(``tessera.planner.estimate.stage_memory`` of ``tessera.train.memory_check.job_spec``: what the memory
check before launch counts) and the memory check's whole predicted peak (model states, activations,
buffers and a process's fixed cost). Measured: the trainer's MemoryLedger after the last step (parameters,
gradients and optimizer states counted from live tensors, the most of any rank; summary.json) and the
kernel's high-water mark of each rank's resident set (VmHWM, sampled from /proc every 0.1 s).

    python benchmarks/lora_memory.py                         # every job, table into docs/LORA.md
    python benchmarks/lora_memory.py --no-write --models small --layouts one,tp2
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
from _procs import descendants, is_rank, sample  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # name -> flags: the model, its precision and a small batch (2 steps of 2 sequences of 64 tokens)
    "small": ["--model.preset=small", "--precision.dtype=fp32"],
    "124M": ["--model.preset=124M", "--precision.dtype=bf16"],
}
LAYOUTS = {  # name -> (local ranks, flags)
    "one": (1, []),
    "dp2-zero2": (2, ["--parallel.dp_replicate=1", "--parallel.dp_shard=2", "--parallel.zero_stage=2"]),
    "dp2-zero3": (2, ["--parallel.dp_replicate=1", "--parallel.dp_shard=2", "--parallel.zero_stage=3"]),
    "tp2": (2, ["--parallel.dp_replicate=1", "--parallel.tp=2"]),
}
LORA = ["--lora.rank=8", '--lora.targets=["wq", "wk", "wv", "wo"]']
COMMON = ["--train.steps=2", "--train.log_every=1", "--train.eval_every=2", "--data.eval_batches=1",
          "--data.seq_len=64", "--data.global_batch_size=2", "--data.micro_batch_size=1", "--run.progress=false",
          "--checkpoint.save_final=false"]
STATES = ("params", "grads", "optimizer")
MB = 1e6


def measure(flags: list[str], nproc: int, out_dir: str) -> tuple[int, dict]:
    """Run one job: (the largest peak resident bytes of its ranks, its summary.json)."""
    cmd = [sys.executable, "-m", "tessera", "train", "--nproc", str(nproc), *flags, f"--run.out_dir={out_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        ranks = [pid for pid in descendants(proc.pid) if is_rank(pid)] or [proc.pid]  # one process: itself
        for pid in ranks:
            peaks[pid] = max(peaks.get(pid, 0), _hwm(pid))
        time.sleep(0.1)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.strip()[-2000:]}")
    summary = json.loads(Path(json.loads(out)["run_dir"], "summary.json").read_text())
    return max(peaks.values()), summary


def _hwm(pid: int) -> int:
    """VmHWM of ``pid``; 0 for a process gone or exiting (a zombie's status has no memory lines)."""
    try:
        return (sample(pid) or {"hwm": 0})["hwm"]
    except StopIteration:
        return 0


def predict(flags: list[str], nproc: int) -> tuple[dict, float]:
    """The planner's model states of the busiest rank by kind, and the memory check's predicted peak."""
    from tessera.planner.estimate import stage_memory
    from tessera.train.config import load_config, validate_config
    from tessera.train.dry_run import planner_layout
    from tessera.train.memory_check import job_spec, predicted_peak

    cfg = validate_config(load_config(None, [*flags, f"--run.nproc={nproc}"]), nproc)
    par = cfg.parallel.resolved(nproc)
    layout, batch, _ = planner_layout(cfg, par)
    precision = "fp32" if cfg.precision.dtype == "fp32" else "mixed"
    mem = max((stage_memory(job_spec(cfg), layout, batch, cfg.data.seq_len, precision, "adam", s)[0]
               for s in range(layout.pp)), key=lambda m: m["total"])
    return {k: mem[k] for k in STATES}, predicted_peak(cfg, par)


def row(model: str, layout: str, lora: bool, tmp: str) -> str:
    nproc, layout_flags = LAYOUTS[layout]
    flags = [*COMMON, *MODELS[model], *layout_flags, *(LORA if lora else []),
             f"--run.name={model}-{layout}-{'lora' if lora else 'full'}"]
    states, peak = predict(flags, nproc)
    rss, summary = measure(flags, nproc, tmp)
    held = {k: max(r[k] for r in summary["memory_per_rank"]) for k in STATES}
    predicted, measured = sum(states.values()), sum(held.values())
    cells = " / ".join(f"{held[k] / MB:,.2f}" for k in STATES)
    return (f"| {model} | {layout} | {'LoRA' if lora else 'full'} | {summary['trainable_parameters']:,} | "
            f"{' / '.join(f'{states[k] / MB:,.2f}' for k in STATES)} | {cells} | {predicted / MB:,.2f} | "
            f"{measured / MB:,.2f} | {(predicted - measured) / measured:+.3%} | {peak / MB:,.0f} | {rss / MB:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/LORA.md alone")
    args = parser.parse_args()
    rows = ["| model | layout | training | trainable parameters | predicted params / grads / optimizer (MB) "
            "| measured params / grads / optimizer (MB) | predicted states (MB) | measured states (MB) | err "
            "| predicted peak, memory check (MB) | measured peak RSS (MB) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for layout in args.layouts.split(","):
                for lora in (False, True):
                    rows.append(row(model, layout, lora, tmp))
                    print(rows[-1], flush=True)
    lines = [f"{provenance()} {time.time() - start:.0f} s in all. Every job: `{' '.join(COMMON)}`; LoRA: "
             f"`{' '.join(LORA)}`. Measured states: the most any rank holds.", "", *rows]
    if not args.no_write:
        replace_section(DOCS / "LORA.md", "lora-memory", "Memory", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
