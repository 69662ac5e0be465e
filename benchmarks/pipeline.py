"""Pipeline parallelism: tessera's schedules against torch.distributed.pipelining, bubbles, convergence.

    python benchmarks/pipeline.py torch        # step time vs ScheduleGPipe / Schedule1F1B /
                                               # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble,
                                               # same model, schedule family, m and v, interleaved A B A B;
                                               # writes the "pipeline" section of docs/BENCHMARKS.md
    python benchmarks/pipeline.py bubble       # measured bubble on timed stages (p=4; m=4,8,16) + Gantt PNGs
    python benchmarks/pipeline.py convergence  # 1F1B vs PipeDream async vs 2BW on the default corpus
Add --no-write to print only.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (DOCS, MIN_ROUNDS, ab_summary, bench_parser, interleaved_times, pool_manager,  # noqa: E402
                     provenance, replace_section, spread, token_batch)

from tessera.models import Transformer, cross_entropy_sum, model_config  # noqa: E402
from tessera.pipeline import PipelineConfig, build_pipeline  # noqa: E402
from tessera.pipeline.measure import measure_bubble  # noqa: E402
from tessera.timeline import Timeline, bubble_fraction, gather, write_chrome_trace, write_gantt_png  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402

# (tessera schedule, virtual stages per rank on BOTH sides, torch schedule). torch's
# ScheduleInterleavedZeroBubble given one stage per rank is its ZB1P with v = 1: forward, input-gradient
# backward I and deferred weight-gradient W per micro-batch, within 1F1B's memory bound — ZB-H1's family.
PAIRS = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"),
         ("interleaved", 2, "ScheduleInterleaved1F1B"), ("zb-h1", 1, "ScheduleInterleavedZeroBubble")]
CHECK_RTOL = 1e-4  # a pair's first-step loss and gradient norm agree this closely (same weights, batch)


# ---- tessera vs torch.distributed.pipelining -----------------------------------------------------------

def torch_pipeline(model, n_stages, pp_group, rank, pp, m, sched_name, loss_fn):
    """torch's schedule over the same stage modules tessera builds (same partition); ``loss_fn`` already
    divides by the global token count, so torch must not scale the gradients by 1/m again."""
    from torch.distributed import pipelining as tp
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    from tessera.pipeline.partition import partition_transformer, stage_modules

    parts = partition_transformer(model, n_stages)
    mods = stage_modules(model, parts, pp, rank)
    stages = [tp.PipelineStage(mod, s, n_stages, torch.device("cpu"), group=pp_group.pg) for s, mod in mods.items()]
    cls = getattr(tp, sched_name)
    multi = issubclass(cls, PipelineScheduleMulti)  # multi-stage classes take a list, even of one stage
    sched = cls(stages if multi else stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    params = [p for mod in mods.values() for p in mod.parameters()]
    return sched, params, 0 in mods, n_stages - 1 in mods


def _probe(losses, params) -> tuple[float | None, float]:
    """(summed micro-batch loss on the last stage's rank, else None; squared norm of this rank's gradients)."""
    loss = float(torch.stack(losses).detach().sum()) if losses else None
    return loss, float(sum(p.grad.detach().double().pow(2).sum() for p in params if p.grad is not None))


def _pair_runners(ours, v, theirs, pp, rank, world_size, preset, layers, x, y, m):
    """Two steps (forward, backward, AdamW update, zero_grad) on identical initial weights; called with
    ``probe=True`` each returns :func:`_probe` of its losses and gradients before the update."""
    tokens = x.numel()

    def loss_fn(out, t):  # the micro-batch's summed token loss / global tokens, the same on both sides
        return cross_entropy_sum(out, t)[0] / tokens

    torch.manual_seed(0)
    model = Transformer(model_config(preset, n_layers=layers))
    micro = list(zip(x.chunk(m), y.chunk(m)))
    pipe = build_pipeline(model, PipelineConfig(schedule=ours, microbatches=m, virtual_stages=v), pp, loss_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

    def run_tessera(probe=False):
        losses = pipe.step(micro).losses
        seen = _probe(losses, pipe.parameters()) if probe else None
        opt.step()
        opt.zero_grad()
        return seen

    sched, params, first, last = torch_pipeline(model, world_size * v, pp, rank, world_size, m, theirs, loss_fn)
    topt = torch.optim.AdamW(params, lr=1e-4)

    def run_torch(probe=False):
        losses = []
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(x, **kwargs) if first else sched.step(**kwargs)
        seen = _probe(losses, params) if probe else None
        topt.step()
        topt.zero_grad()
        return seen

    return run_tessera, run_torch


def torch_worker(rank, world_size, preset, layers, batch, seq, m, rounds, steps, warmup):
    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=600))
    try:
        pp = topo.group("pp")
        x, y = token_batch(0, batch, seq)
        steppers, first = {}, {}
        for ours, v, theirs in PAIRS:
            for who, fn in zip(("tessera", "torch"), _pair_runners(ours, v, theirs, pp, rank, world_size,
                                                                   preset, layers, x, y, m)):
                first[(who, ours)] = fn(probe=True)  # a first, untimed step: the like-for-like check

                def timed(fn=fn):
                    t0 = time.perf_counter()
                    fn()
                    return time.perf_counter() - t0
                steppers[(who, ours)] = timed  # dict order = tessera then torch, per schedule, every round
        return {"times": interleaved_times(steppers, rounds, warmup, steps), "first": first}
    finally:
        topo.destroy()


def _check_same_step(res, ours, theirs) -> None:
    """Both sides trained the same model on the same batch: their first losses and, on every rank, the
    norms of the gradients they step with must agree (a loss scaled differently would show here)."""
    for r in res:
        (la, ga), (lb, gb) = r["first"][("tessera", ours)], r["first"][("torch", ours)]
        same_loss = (la is None) == (lb is None) and (la is None or abs(la - lb) <= CHECK_RTOL * abs(lb))
        if not same_loss or abs(ga - gb) > CHECK_RTOL * gb:
            raise SystemExit(f"pipeline.py: {ours} and {theirs} are not like for like: first-step loss "
                             f"{la} vs {lb}, squared gradient norm {ga:.6g} vs {gb:.6g}.")


def run_torch_compare(args, pools) -> None:
    rows = []
    for world in args.ranks:
        res = pools.run(torch_worker, world, timeout=3000.0, preset=args.preset, layers=args.layers,
                        batch=args.batch, seq=args.seq, m=args.microbatches, rounds=args.rounds,
                        steps=args.steps, warmup=args.warmup)
        for ours, v, theirs in PAIRS:
            _check_same_step(res, ours, theirs)
            s = ab_summary([r["times"] for r in res], ("tessera", ours), ("torch", ours))
            t_ours, t_theirs = (statistics.median(s[k]) for k in (("tessera", ours), ("torch", ours)))
            rows.append(f"| {world} | {args.microbatches} | {v} | {ours} | {theirs} | {t_ours:.4f} | "
                        f"{t_theirs:.4f} | **{spread(s['ratio'])}** |")
            print(rows[-1], flush=True)
    params = model_config(args.preset, n_layers=args.layers).num_params()
    lines = [
        f"{provenance()} Model: `{args.preset}` preset with {args.layers} layers ({params / 1e6:.2f}M "
        f"parameters); batch {args.batch}×{args.seq} tokens in m = {args.microbatches} micro-batches; the same "
        "stage modules (same partition) and the same loss (summed token loss / global tokens, torch with "
        "`scale_grads=False`) on both sides, checked equal (loss and gradient norm) at a first, untimed "
        "step; AdamW lr 1e-4 on both; "
        f"{args.rounds} interleaved rounds (per schedule, tessera then torch) of {args.warmup} warm-up + "
        f"{args.steps} timed steps, each timed step being forward + backward + optimizer step + zero_grad. "
        "Step time = the slowest rank's median over a round, then the median over rounds; ratio = median "
        "(min–max) over rounds of tessera / torch per round. Target ≤ 1.00. Like for like: each pair has the "
        "same schedule family, micro-batches m and virtual stages v; torch's ScheduleInterleavedZeroBubble "
        "is given one stage per rank (v = 1), which makes it ZB1P with ZB-H1's split of the backward into "
        "input gradient and deferred weight gradient.",
        "",
        "| pp | m | v | tessera | torch.distributed.pipelining | tessera step (s) | torch step (s) | "
        "ratio median (min–max) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    if not args.no_write:
        replace_section(DOCS / "BENCHMARKS.md", "pipeline", "Pipeline parallelism: tessera vs "
                        "torch.distributed.pipelining (CPU, gloo)", lines)


# ---- measured bubble ------------------------------------------------------------------------------------

def bubble_worker(rank, world_size, cases, forward_s, out_dir):
    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=600))
    try:
        res = {}
        for name, m, v in cases:
            r = measure_bubble(topo.group("pp"), name, m, v, forward_s=forward_s, steps=5)
            res[(name, m, v)] = (r["bubble"], r["peak"])
            if rank == 0 and m == 8 and out_dir:
                write_gantt_png(os.path.join(out_dir, f"pipeline_{name}.png"), r["events"],
                                title=f"{name} p={world_size} m={m} v={v}", bubble=r["bubble"])
        return res
    finally:
        topo.destroy()


def run_bubble(args, pools) -> None:
    p = 4
    cases = [(s, m, 1) for s in ("gpipe", "1f1b", "zb-h1") for m in (4, 8, 16)]
    cases += [("interleaved", m, 2) for m in (4, 8, 16)]
    res = pools.run(bubble_worker, p, timeout=3000.0, cases=cases, forward_s=args.forward_s,
                    out_dir=None if args.no_write else str(DOCS))
    rows = []
    for name, m, v in cases:
        bubble, _ = res[0][(name, m, v)]
        peak = max(r[(name, m, v)][1] for r in res)
        rows.append(f"| {name}{f' (v={v})' if v > 1 else ''} | {m} | {bubble:.3f} | {(p - 1) / (m + p - 1):.3f} "
                    f"| {peak} |")
        print(rows[-1], flush=True)
    lines = [f"{provenance()} p = 4 gloo ranks, TimedStage stages sleeping forward {args.forward_s * 1e3:.0f} "
             "ms and backward twice that (ZB-H1: B and W one forward each; interleaved: each of the v chunks 1/v "
             "of it); bubble = 1 − compute time / (4 × wall window) from the Timeline of the least-disturbed of "
             "5 steps after a warm-up.", "",
             "| schedule | m | measured bubble | (p−1)/(m+p−1) | peak live micro-batches (max rank) |",
             "|---|---|---|---|---|", *rows]
    if not args.no_write:
        replace_section(DOCS / "PIPELINE.md", "bubble", "Measured bubble", lines)


# ---- convergence ----------------------------------------------------------------------------------------

def convergence_worker(rank, world_size, schedule, steps, m, batch, seq, lr, cache_dir, out_dir):
    from tessera.train.data import DataConfig, load_corpus

    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=600))
    try:
        corpus = load_corpus(DataConfig(cache_dir=cache_dir))
        tokens = torch.from_numpy(corpus.train[: 2_000_000].astype("int64"))
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", n_layers=4, dim=64, ffn_hidden_dim=128, n_heads=4, n_kv_heads=2))
        holder = {}

        def on_step():  # PipeDream: an update after every micro-batch's backward
            holder["opt"].step()
            holder["opt"].zero_grad(set_to_none=True)

        per_mb = schedule == "pipedream"  # async updates use each micro-batch's own mean loss
        scale = float((batch // m) * seq) if per_mb else float(batch * seq)
        timeline = Timeline(rank)
        pipe = build_pipeline(model, PipelineConfig(schedule=schedule, microbatches=m), topo.group("pp"),
                              lambda out, y: cross_entropy_sum(out, y)[0] / scale, timeline=timeline,
                              on_step=on_step)
        holder["opt"] = torch.optim.AdamW(pipe.parameters(), lr=lr / m if per_mb else lr)
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(steps):
            starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
            win = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
            timeline.clear()
            out = pipe.step(list(zip(win[:, :-1].chunk(m), win[:, 1:].chunk(m))))
            loss = float(pipe.loss(out)) / (m if per_mb else 1)
            losses.append(loss)
            if not per_mb:
                holder["opt"].step()
                holder["opt"].zero_grad(set_to_none=True)
        events = gather(timeline, topo.group("pp"))
        if rank == 0 and out_dir:
            write_chrome_trace(os.path.join(out_dir, f"trace_{schedule}.json"), events)
        return {"losses": losses, "bubble": bubble_fraction(events, world_size)[0]}
    finally:
        topo.destroy()


def run_convergence(args, pools) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    for schedule in ("1f1b", "pipedream", "2bw"):
        res = pools.run(convergence_worker, 2, timeout=3000.0, schedule=schedule, steps=args.steps, m=4,
                        batch=16, seq=64, lr=3e-3, cache_dir=args.cache_dir, out_dir=None)
        curves[schedule] = res[0]["losses"]
        print(schedule, " ".join(f"{x:.3f}" for x in curves[schedule][:: max(1, args.steps // 10)]), flush=True)
    if args.no_write:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name)
    ax.set_xlabel("batch (16×64 tokens, 4 micro-batches)")
    ax.set_ylabel("training loss")
    ax.set_title("pp=2, tiny-64 Transformer, default corpus")
    ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "pipeline_convergence.png", dpi=120)
    (DOCS / "pipeline_convergence.json").write_text(json.dumps(curves))
    k = max(1, args.steps // 10)
    lines = [f"{provenance()} "
             "pp = 2 gloo ranks, Transformer dim 64, 4 layers, vocab 256; batches of 16×64 tokens from the "
             "default corpus in 4 micro-batches; AdamW lr 3e-3 (PipeDream async: lr/4 per micro-batch update).",
             "", "![convergence](pipeline_convergence.png)", "",
             "| step | " + " | ".join(curves) + " |", "|---" * (len(curves) + 1) + "|"]
    for i in range(0, args.steps, k):
        lines.append(f"| {i + 1} | " + " | ".join(f"{curves[c][i]:.3f}" for c in curves) + " |")
    lines.append(f"| {args.steps} | " + " | ".join(f"{curves[c][-1]:.3f}" for c in curves) + " |")
    replace_section(DOCS / "PIPELINE.md", "convergence", "Convergence: PipeDream async and 2BW beside 1F1B", lines)


def _check_args(parser, args) -> None:
    """One sentence and exit 2 for a shape some pair cannot run, before any rank starts."""
    v = max(v for _, v, _ in PAIRS)
    for world in args.ranks:
        if world * v > args.layers:
            parser.error(f"--ranks {world} with virtual stages {v} needs at least {world * v} layers; "
                         f"pass --layers {world * v}.")
        if args.microbatches % world or args.batch % args.microbatches:
            parser.error(f"--microbatches {args.microbatches} must be a multiple of every --ranks value "
                         f"({world}) and divide --batch {args.batch}.")


def main() -> None:
    parser = bench_parser(__doc__, ranks=[2], preset="small", batch=8, seq=128, rounds=MIN_ROUNDS, steps=3,
                          warmup=1, no_write_help=None)
    parser.add_argument("what", choices=["torch", "bubble", "convergence"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--forward-s", type=float, default=0.03)
    parser.add_argument("--cache-dir", default="")
    args = parser.parse_args()
    if args.what == "torch":
        _check_args(parser, args)
    with pool_manager() as pools:
        {"torch": run_torch_compare, "bubble": run_bubble, "convergence": run_convergence}[args.what](args, pools)


if __name__ == "__main__":
    main()
