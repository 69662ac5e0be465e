"""The 3D demo (`tessera train`) against plain data parallelism on 2 ranks: the same loss curve?

README says `make train` (dp2 x tp2 x pp2, 1F1B, 8 ranks) ends at the validation loss plain DDP reaches.
This script backs that sentence: it runs both jobs one after the other through the CLI, with the same
model, seed, data and global batch, and compares every logged training loss and every validation loss.
The parity tests prove the same on tiny shapes; this is the full 300-step run the README quotes.

    python benchmarks/demo_curve.py            # both runs (about 6 minutes on 2 cores), then docs/BENCHMARKS.md
    python benchmarks/demo_curve.py --no-write # print only
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

RUNS = {  # name -> the CLI arguments after `tessera train` (no layout key: the demo)
    "3d": [],
    "ddp2": ["--nproc", "2"],
}


def run(name: str, out_dir: Path, steps: int | None) -> tuple[list[dict], float]:
    """One job through the CLI; its metrics.jsonl records and wall seconds."""
    args = [sys.executable, "-m", "tessera", "train", *RUNS[name], f"--run.out_dir={out_dir}",
            f"--run.name={name}", "--run.progress=false", "--checkpoint.save_final=false"]
    if steps is not None:
        args.append(f"--train.steps={steps}")
    start = time.perf_counter()
    subprocess.run(args, check=True)
    lines = (out_dir / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines], time.perf_counter() - start


def compare(a: list[dict], b: list[dict]) -> dict:
    """Largest relative differences of the logged training losses and of the validation losses."""
    def series(records, kind, key):
        return {r["step"]: r[key] for r in records if r["kind"] == kind}

    out = {}
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        x, y = series(a, kind, key), series(b, kind, key)
        if x.keys() != y.keys():
            raise SystemExit(f"the runs logged different {kind} steps: {sorted(x)} vs {sorted(y)}")
        rel = {s: abs(x[s] - y[s]) / abs(y[s]) for s in sorted(x)}
        out[kind] = max(rel.values())
        out[f"{kind}_last"] = (x[max(x)], y[max(y)])
        if kind == "train":  # rounding differences (reduction order) compound: where they pass 1e-5
            out["train_first"] = rel[min(rel)]
            out["train_1e-5_from"] = next((s for s, r in rel.items() if r > 1e-5), None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="train.steps for both runs (default: the demo's)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, Path(tmp), args.steps) for name in RUNS}
    diff = compare(results["3d"][0], results["ddp2"][0])
    (v3, vd), (t3, td) = diff["eval_last"], diff["train_last"]
    lines = [
        f"{provenance()} Both runs through the CLI: the "
        f"demo (`tessera train`: dp2 × tp2 × pp2, 1F1B, 8 ranks, {results['3d'][1]:.0f} s) and plain DDP "
        f"(`tessera train --nproc 2`, {results['ddp2'][1]:.0f} s), same model, seed, data and global batch.",
        "",
        "| | 3D demo | DDP, 2 ranks | largest relative difference over the run |",
        "|---|---|---|---|",
        f"| final validation loss | {v3:.4f} | {vd:.4f} | {diff['eval']:.1e} (every validation) |",
        f"| final logged training loss | {t3:.4f} | {td:.4f} | {diff['train']:.1e} (every logged step) |",
        "",
        f"The first logged step differs by {diff['train_first']:.1e}; the difference first passes 1e-5 at "
        f"step {diff['train_1e-5_from']}. Both layouts compute the same sums in a different order (tensor-"
        "parallel partial sums, pipeline micro-batches), and the fp32 rounding differences that this leaves "
        "grow over hundreds of optimizer steps, as they do between any two reduction orders; the parity "
        "tests (fp32, a few steps) bound them at 1e-5.",
    ]
    print("\n".join(lines))
    if not args.no_write:
        replace_section(DOCS / "BENCHMARKS.md", "demo-curve", "The 3D demo against plain DDP (CPU, gloo)", lines)


if __name__ == "__main__":
    main()
