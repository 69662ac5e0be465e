"""Train `moe-small` on the default corpus and check the balancing loss keeps expert load in a band.

One process (expert placement does not change routing: the parity tests show ep ranks route exactly
as one process), AdamW, the house loss: (CE sum + MoE loss sum) / tokens. Two runs from the same seed
and data: with the load-balancing loss (aux_loss_coef = 0.01) and without it (0.0), to show what the
loss does. Load = tokens routed to an expert (before capacity) / its uniform share T·k/E, per MoE layer
and step. The band is stated up front: after the first WARMUP steps, every expert's load stays in
[BAND_LO, BAND_HI] at every step with the balancing loss.

    python benchmarks/moe_convergence.py                  # writes docs/moe_expert_load.png and docs/MOE.md's table
    python benchmarks/moe_convergence.py --steps 20 --no-write
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, load_note, machine, replace_section  # noqa: E402

from tessera.models import Transformer, cross_entropy_sum, model_config  # noqa: E402
from tessera.models.moe import MoEConfig, moe_loss_sum  # noqa: E402
from tessera.moe import moe_metrics  # noqa: E402
from tessera.moe.plot import plot_expert_load  # noqa: E402
from tessera.comm import CommGroup  # noqa: E402
from tessera.train.data import DataConfig, WindowSampler, load_corpus, make_batch  # noqa: E402

BAND_LO, BAND_HI, WARMUP = 0.25, 2.0, 50


def run(aux_coef: float, args) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = model_config("moe-small")
    moe = MoEConfig(top_k=args.top_k, aux_loss_coef=aux_coef)
    model = Transformer(cfg, moe)
    data = DataConfig(seq_len=args.seq, global_batch_size=args.batch, micro_batch_size=args.batch)
    corpus = load_corpus(data)
    sampler = WindowSampler(len(corpus.train), data.seq_len, data.global_batch_size, data.micro_batch_size,
                            0, 1, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    single = CommGroup.single("dp")
    rows, t0 = [], time.perf_counter()
    for step in range(args.steps):
        (ids,) = sampler.next_step()
        x, y = make_batch(corpus.train, ids, data.seq_len)
        ce, n = cross_entropy_sum(model(x), y)
        ((ce + moe_loss_sum(model)) / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        m = moe_metrics(model, single)
        rows.append({"step": step, "loss": float(ce.detach()) / n, **m})
        if step % 20 == 0:
            load = m["moe_load_per_layer"]
            print(f"aux={aux_coef} step {step} loss {rows[-1]['loss']:.3f} load min {min(map(min, load)):.2f} "
                  f"max {max(map(max, load)):.2f} dropped {m['moe_dropped_frac']:.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return {"rows": rows, "params": cfg.num_params(moe=moe), "seconds": time.perf_counter() - t0}


def _inside(rows: list[dict]) -> float:
    loads = [v for r in rows for layer in r["moe_load_per_layer"] for v in layer]
    return sum(BAND_LO <= v <= BAND_HI for v in loads) / len(loads)


def band_summary(rows: list[dict]) -> dict:
    late = [r for r in rows if r["step"] >= WARMUP]
    loads = [v for r in late for layer in r["moe_load_per_layer"] for v in layer]
    return {"min": min(loads), "max": max(loads), "inside": _inside(late), "inside_last50": _inside(rows[-50:]),
            "dropped": sum(r["moe_dropped_frac"] for r in late) / len(late),
            "loss_first": rows[0]["loss"], "loss_last": sum(r["loss"] for r in rows[-10:]) / 10}


def write_docs(results: dict, args) -> None:
    on = results[0.01]["rows"]
    plot_expert_load([r["step"] for r in on], [r["moe_load_per_layer"] for r in on], str(DOCS / "moe_expert_load.png"),
                     (BAND_LO, BAND_HI), title=f"aux 0.01, top-{args.top_k}")
    lines = [f"Measured by `python benchmarks/moe_convergence.py --steps {args.steps}` on {machine()}, "
             f"one process, {load_note()}. Model `moe-small` "
             f"({results[0.01]['params'] / 1e6:.2f}M parameters: dim 256, 4 layers, 8 SwiGLU experts of 344 "
             f"hidden units in blocks 1 and 3), top-{args.top_k}, capacity factor 1.25, batch "
             f"{args.batch}×{args.seq} tokens of the default corpus, AdamW lr {args.lr}. Load = routed tokens / "
             f"uniform share; statistics over steps {WARMUP}–{args.steps - 1}, every expert of both MoE layers.", "",
             "| aux_loss_coef | load min | load max | share of (step, expert) loads in "
             f"[{BAND_LO}, {BAND_HI}] | same, last 50 steps | dropped fraction | loss step 0 → mean of last 10 |",
             "|---|---|---|---|---|---|---|"]
    for coef, res in results.items():
        s = band_summary(res["rows"])
        lines.append(f"| {coef} | {s['min']:.2f} | {s['max']:.2f} | {100 * s['inside']:.1f}% | {100 * s['inside_last50']:.1f}% | {s['dropped']:.3f} "
                     f"| {s['loss_first']:.2f} → {s['loss_last']:.2f} |")
    replace_section(DOCS / "MOE.md", "moe-convergence", "Load balancing on the default corpus", lines)
    (DOCS / "moe_convergence.json").write_text(json.dumps({str(k): band_summary(v["rows"]) for k, v in results.items()},
                                                          indent=1), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import multiprocessing as mp

    coefs = (0.01, 0.0)
    with mp.get_context("spawn").Pool(len(coefs)) as pool:  # the two runs side by side, one core each
        results = dict(zip(coefs, pool.starmap(run, [(c, args) for c in coefs])))
    for coef, res in results.items():
        print(coef, band_summary(res["rows"]), f"{res['seconds']:.0f}s")
    if not args.no_write:
        write_docs(results, args)


if __name__ == "__main__":
    main()
