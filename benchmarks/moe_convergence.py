"""Train `moe-small` on the default corpus and check the balancing loss keeps expert load in a band.

One process (expert placement does not change routing: the parity tests show ep ranks route exactly
as one process), the trainer's optimizer (AdamW, 30 warm-up steps, cosine decay, gradient clipping at
1.0: ``tessera.train.optim`` defaults) and the house loss: (CE sum + MoE loss sum) / tokens. Three runs
from the same seed and data that differ only in the router:

- ``rsample, aux 0.01``: Gumbel-sampled top-k (``noisy_gate_policy = "rsample"``) with the balancing loss;
- ``none, aux 0.01``: deterministic top-k with the balancing loss (the router defaults);
- ``rsample, aux 0``: sampled top-k without the balancing loss (what the loss itself does).

Load = tokens routed to an expert (before capacity) / its uniform share T·k/E, per MoE layer and step.
Validation loss: the mean cross-entropy over VAL_BATCHES fixed (seeded) batches of the validation split, in
eval mode (no router noise), after the last step.

The band, stated before the run: from step WARMUP = 50 on, every expert of both MoE layers has a load in
[BAND_LO, BAND_HI] = [0.25, 2.0] at every step of the ``rsample, aux 0.01`` run.

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
from _common import DOCS, provenance, replace_section  # noqa: E402

from tessera.models import Transformer, cross_entropy_sum, model_config  # noqa: E402
from tessera.models.moe import MoEConfig, moe_loss_sum  # noqa: E402
from tessera.moe import moe_metrics  # noqa: E402
from tessera.moe.plot import plot_expert_load  # noqa: E402
from tessera.comm import CommGroup  # noqa: E402
from tessera.train.data import DataConfig, WindowSampler, load_corpus, make_batch  # noqa: E402
from tessera.train.optim import OptimConfig, build_optimizer, build_scheduler  # noqa: E402

BAND_LO, BAND_HI, WARMUP = 0.25, 2.0, 50
VAL_BATCHES = 16
# label -> router options (everything else is the same in every run)
RUNS = {
    "rsample, aux 0.01": dict(noisy_gate_policy="rsample", aux_loss_coef=0.01),
    "none, aux 0.01": dict(noisy_gate_policy="none", aux_loss_coef=0.01),
    "rsample, aux 0": dict(noisy_gate_policy="rsample", aux_loss_coef=0.0),
}
BALANCED = "rsample, aux 0.01"  # the run the band is stated for


def val_loss(model: Transformer, corpus, data: DataConfig) -> float:
    """Mean cross-entropy per token over VAL_BATCHES seeded validation batches (eval mode: no router noise)."""
    sampler = WindowSampler(len(corpus.val), data.seq_len, data.global_batch_size, data.micro_batch_size,
                            0, 1, seed=0)
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for _ in range(VAL_BATCHES):
            (ids,) = sampler.next_step()
            x, y = make_batch(corpus.val, ids, data.seq_len)
            ce, n = cross_entropy_sum(model(x), y)
            total, tokens = total + float(ce), tokens + n
    model.train()
    return total / tokens


def run(label: str, args) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = model_config("moe-small")
    moe = MoEConfig(top_k=args.top_k, **RUNS[label])
    model = Transformer(cfg, moe)
    data = DataConfig(seq_len=args.seq, global_batch_size=args.batch, micro_batch_size=args.batch)
    corpus = load_corpus(data)
    sampler = WindowSampler(len(corpus.train), data.seq_len, data.global_batch_size, data.micro_batch_size,
                            0, 1, seed=0)
    optim = OptimConfig(lr=args.lr)
    opt = build_optimizer(model, optim)
    sched = build_scheduler(opt, optim, args.steps)
    single = CommGroup.single("dp")
    rows, t0 = [], time.perf_counter()
    for step in range(args.steps):
        (ids,) = sampler.next_step()
        x, y = make_batch(corpus.train, ids, data.seq_len)
        ce, n = cross_entropy_sum(model(x), y)
        ((ce + moe_loss_sum(model)) / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        m = moe_metrics(model, [single])
        rows.append({"step": step, "loss": float(ce.detach()) / n, **m})
        if step % 20 == 0:
            load = m["moe_load_per_layer"]
            print(f"[{label}] step {step} loss {rows[-1]['loss']:.3f} load min {min(map(min, load)):.2f} "
                  f"max {max(map(max, load)):.2f} dropped {m['moe_dropped_frac']:.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return {"rows": rows, "params": cfg.num_params(moe=moe), "val_loss": val_loss(model, corpus, data),
            "seconds": time.perf_counter() - t0}


def _inside(rows: list[dict]) -> float:
    loads = [v for r in rows for layer in r["moe_load_per_layer"] for v in layer]
    return sum(BAND_LO <= v <= BAND_HI for v in loads) / len(loads)


def band_summary(res: dict) -> dict:
    rows = res["rows"]
    late = [r for r in rows if r["step"] >= WARMUP] or rows  # a short trial run: every step
    loads = [v for r in late for layer in r["moe_load_per_layer"] for v in layer]
    return {"min": min(loads), "max": max(loads), "inside": _inside(late), "inside_last50": _inside(rows[-50:]),
            "dropped": sum(r["moe_dropped_frac"] for r in late) / len(late),
            "loss_first": rows[0]["loss"], "loss_last": sum(r["loss"] for r in rows[-10:]) / len(rows[-10:]),
            "val_loss": res["val_loss"]}


def write_docs(results: dict, args) -> None:
    on = results[BALANCED]["rows"]
    plot_expert_load([r["step"] for r in on], [r["moe_load_per_layer"] for r in on], str(DOCS / "moe_expert_load.png"),
                     (BAND_LO, BAND_HI), title=f"{BALANCED}, top-{args.top_k}")
    lines = [f"{provenance()} One process per run. Model `moe-small` "
             f"({results[BALANCED]['params'] / 1e6:.2f}M parameters: dim 256, 4 layers, 8 SwiGLU experts of 344 "
             f"hidden units in blocks 1 and 3), top-{args.top_k}, capacity factor 1.25, batch "
             f"{args.batch}×{args.seq} tokens of the default corpus, the trainer's AdamW (peak lr {args.lr}, "
             f"30 warm-up steps, cosine decay, clipping at 1.0). Load = routed tokens / uniform share; statistics "
             f"over steps {WARMUP}–{args.steps - 1}, every expert of both MoE layers. Validation loss: mean "
             f"cross-entropy over {VAL_BATCHES} batches of the validation split after the last step.", "",
             "| router | load min | load max | share of (step, layer, expert) loads in "
             f"[{BAND_LO}, {BAND_HI}] | same, last 50 steps | dropped fraction | train loss step 0 → mean of last 10 "
             "| validation loss |",
             "|---|---|---|---|---|---|---|---|"]
    for label, res in results.items():
        s = band_summary(res)
        lines.append(f"| {label} | {s['min']:.2f} | {s['max']:.2f} | {100 * s['inside']:.1f}% | "
                     f"{100 * s['inside_last50']:.1f}% | {s['dropped']:.3f} | {s['loss_first']:.2f} → "
                     f"{s['loss_last']:.2f} | {s['val_loss']:.3f} |")
    replace_section(DOCS / "MOE.md", "moe-convergence", "Load balancing on the default corpus", lines)
    (DOCS / "moe_convergence.json").write_text(json.dumps({k: band_summary(v) for k, v in results.items()},
                                                          indent=1), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--lr", type=float, default=OptimConfig.lr)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(len(RUNS)) as pool:  # the runs side by side, one core each
        results = dict(zip(RUNS, pool.starmap(run, [(label, args) for label in RUNS])))
    for label, res in results.items():
        print(label, band_summary(res), f"{res['seconds']:.0f}s")
    if not args.no_write:
        write_docs(results, args)


if __name__ == "__main__":
    main()
