"""Pipeline parallelism: tessera's schedules against torch.distributed.pipelining, bubbles, convergence.

    python benchmarks/pipeline.py torch        # step time vs ScheduleGPipe / Schedule1F1B /
                                               # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble,
                                               # same model, same ranks, interleaved A B A B; writes the
                                               # "pipeline" section of docs/BENCHMARKS.md
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
from _common import DOCS, bench_parser, load_note, machine, pool_manager, replace_section, token_batch  # noqa: E402

from tessera.models import Transformer, cross_entropy_sum, model_config  # noqa: E402
from tessera.pipeline import PipelineConfig, build_pipeline  # noqa: E402
from tessera.pipeline.measure import measure_bubble  # noqa: E402
from tessera.timeline import Timeline, bubble_fraction, gather, write_chrome_trace, write_gantt_png  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402

PAIRS = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"),
         ("interleaved", 2, "ScheduleInterleaved1F1B"), ("zb-h1", 1, "ScheduleInterleavedZeroBubble")]


# ---- tessera vs torch.distributed.pipelining -----------------------------------------------------------

def torch_pipeline(model, n_stages, pp_group, rank, pp, m, sched_name):
    from torch.distributed import pipelining as tp

    from tessera.pipeline.partition import partition_transformer, stage_modules

    parts = partition_transformer(model, n_stages)
    mods = stage_modules(model, parts, pp, rank)
    stages = [tp.PipelineStage(mod, s, n_stages, torch.device("cpu"), group=pp_group.pg) for s, mod in mods.items()]

    def loss_fn(out, y):
        return cross_entropy_sum(out, y)[0] / y.numel()

    cls = getattr(tp, sched_name)
    sched = cls(stages if len(stages) > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn)
    params = [p for mod in mods.values() for p in mod.parameters()]
    return sched, params, 0 in mods, n_stages - 1 in mods


def torch_worker(rank, world_size, preset, layers, batch, seq, m, rounds, steps, warmup):
    import torch.distributed as dist

    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=600))
    try:
        pp = topo.group("pp")
        x, y = token_batch(0, batch, seq)
        micro = list(zip(x.chunk(m), y.chunk(m)))
        runners = {}
        for ours, v, theirs in PAIRS:
            torch.manual_seed(0)
            model = Transformer(model_config(preset, n_layers=layers))
            pipe = build_pipeline(model, PipelineConfig(schedule=ours, microbatches=m, virtual_stages=v), pp,
                                  lambda out, t: cross_entropy_sum(out, t)[0] / t.numel())
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
            runners[("tessera", ours)] = (lambda p=pipe, o=opt: (p.step(micro), o.step(), o.zero_grad()))
            tv = 2 if theirs in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble") else 1
            sched, params, first, last = torch_pipeline(model, world_size * tv, pp, rank, world_size, m, theirs)
            topt = torch.optim.AdamW(params, lr=1e-4)

            def run_torch(s=sched, o=topt, first=first, last=last):
                kwargs = {"target": y, "losses": []} if last else {}
                s.step(x, **kwargs) if first else s.step(**kwargs)
                o.step()
                o.zero_grad()
            runners[("torch", ours)] = run_torch
        times = {k: [] for k in runners}
        for _ in range(rounds):
            for ours, _, _ in PAIRS:
                for who in ("tessera", "torch"):  # A B, every round
                    fn = runners[(who, ours)]
                    for _ in range(warmup):
                        fn()
                    dist.barrier(group=pp.pg)
                    ts = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t0)
                    times[(who, ours)].append(statistics.median(ts))
        return times
    finally:
        topo.destroy()


def run_torch_compare(args, pools) -> None:
    rows = []
    for world in args.ranks:
        res = pools.run(torch_worker, world, timeout=3000.0, preset=args.preset, layers=args.layers,
                        batch=args.batch, seq=args.seq, m=args.microbatches, rounds=args.rounds,
                        steps=args.steps, warmup=args.warmup)
        for ours, v, theirs in PAIRS:
            per_round = [max(r[("tessera", ours)][i] for r in res) / max(r[("torch", ours)][i] for r in res)
                         for i in range(args.rounds)]
            t_ours = statistics.median(max(r[("tessera", ours)][i] for r in res) for i in range(args.rounds))
            t_theirs = statistics.median(max(r[("torch", ours)][i] for r in res) for i in range(args.rounds))
            rows.append(f"| {world} | {ours}{f' (v={v})' if v > 1 else ''} | {theirs} | {t_ours:.4f} | "
                        f"{t_theirs:.4f} | **{statistics.median(per_round):.3f}** | "
                        f"{', '.join(f'{r:.3f}' for r in per_round)} |")
            print(rows[-1], flush=True)
    params = model_config(args.preset, n_layers=args.layers).num_params()
    lines = [
        f"Measured by `python benchmarks/pipeline.py torch` on {machine()} ({load_note()}). "
        f"Model: `{args.preset}` preset with {args.layers} layers ({params / 1e6:.2f}M "
        f"parameters); batch {args.batch}×{args.seq} tokens in {args.microbatches} micro-batches; AdamW; "
        f"{args.rounds} interleaved rounds (tessera then torch, per schedule) of {args.warmup} warm-up + "
        f"{args.steps} timed steps. Step time = median over a round on the slowest rank; ratio = median over "
        "rounds of tessera / torch. Target ≤ 1.0. torch has no single-chunk zero-bubble schedule, so "
        "tessera's ZB-H1 (v=1) is set against ScheduleInterleavedZeroBubble (v=2).",
        "",
        "| pp | tessera | torch.distributed.pipelining | tessera step (s) | torch step (s) | ratio | per round |",
        "|---|---|---|---|---|---|---|",
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
    lines = [f"Measured by `python benchmarks/pipeline.py bubble` on {machine()} (shared machine): p = 4 gloo "
             f"ranks, TimedStage stages sleeping forward {args.forward_s * 1e3:.0f} ms and backward twice that "
             "(ZB-H1: B and W one forward each; interleaved: each of the v chunks 1/v of it); bubble = "
             "1 − compute time / (4 × wall window) from the Timeline of the least-disturbed of 5 steps after a warm-up.", "",
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
    lines = [f"Measured by `python benchmarks/pipeline.py convergence --steps {args.steps}` on {machine()}: "
             "pp = 2 gloo ranks, Transformer dim 64, 4 layers, vocab 256; batches of 16×64 tokens from the "
             "default corpus in 4 micro-batches; AdamW lr 3e-3 (PipeDream async: lr/4 per micro-batch update).",
             "", "![convergence](pipeline_convergence.png)", "",
             "| step | " + " | ".join(curves) + " |", "|---" * (len(curves) + 1) + "|"]
    for i in range(0, args.steps, k):
        lines.append(f"| {i + 1} | " + " | ".join(f"{curves[c][i]:.3f}" for c in curves) + " |")
    lines.append(f"| {args.steps} | " + " | ".join(f"{curves[c][-1]:.3f}" for c in curves) + " |")
    replace_section(DOCS / "PIPELINE.md", "convergence", "Convergence: PipeDream async and 2BW beside 1F1B", lines)


def main() -> None:
    parser = bench_parser(__doc__, ranks=[2], preset="small", batch=8, seq=128, rounds=3, steps=3, warmup=1,
                          no_write_help=None)
    parser.add_argument("what", choices=["torch", "bubble", "convergence"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--forward-s", type=float, default=0.03)
    parser.add_argument("--cache-dir", default="")
    args = parser.parse_args()
    with pool_manager() as pools:
        {"torch": run_torch_compare, "bubble": run_bubble, "convergence": run_convergence}[args.what](args, pools)


if __name__ == "__main__":
    main()
