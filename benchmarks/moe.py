"""Expert parallelism against the same MoE replicated under DDP: step time and expert memory per rank.

Both run in the same gloo world, in the same processes, interleaved A B A B over several rounds:
A = tessera expert parallelism (ep = ranks: experts sharded, tokens by all-to-all, dense gradients
all-reduced over dp and expert gradients over edp, here of size 1); B = the same MoE model, every expert
on every rank, under torch.nn.parallel.DistributedDataParallel. A step is forward + backward + AdamW.
Expert-parameter memory per rank is counted from the live parameters of each rank's model.

    python benchmarks/moe.py                     # 2 and 4 ranks, moe-small, writes docs/BENCHMARKS.md
    python benchmarks/moe.py --ranks 2 --rounds 2 --no-write
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (DOCS, ab_summary, bench_parser, interleaved_times, load_note, machine,  # noqa: E402
                     no_forward_buffer_sync, pool_manager, replace_section, token_batch)

from tessera.models import Transformer, cross_entropy_sum, model_config  # noqa: E402
from tessera.models.moe import MoEConfig, moe_layers, moe_loss_sum  # noqa: E402
from tessera.moe import ExpertDataParallel, apply_expert_parallel  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402

DOC = DOCS / "BENCHMARKS.md"


def _step(model, opt, x, y, world) -> float:
    t0 = time.perf_counter()
    ce, n = cross_entropy_sum(model(x), y)
    ((ce + moe_loss_sum(model)) / (n * world)).backward()  # equal batches: n·world = global tokens
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for layer in moe_layers(model) for p in layer.experts.parameters())


def bench_worker(rank, world_size, preset, top_k, batch, seq, rounds, steps, warmup):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    topo = Topology.build(ParallelConfig(dp_replicate=world_size, ep=world_size))
    try:
        def build(kind):
            torch.manual_seed(0)
            core = Transformer(model_config(preset), MoEConfig(top_k=top_k))
            if kind == "ep":
                apply_expert_parallel(core, topo.group("ep"))
                model = ExpertDataParallel(core, topo.group("dp"), topo.group("edp"))
            else:
                model = TorchDDP(core, process_group=dist.group.WORLD, **no_forward_buffer_sync())
            return model, core, torch.optim.AdamW(core.parameters(), lr=1e-4)

        models = {kind: build(kind) for kind in ("ep", "ddp")}
        x, y = token_batch(rank, batch, seq)
        a2a_per_step = 0.0

        @contextmanager
        def count_all_to_all(kind):  # ep-axis all-to-all wire bytes of EP's timed steps (the last round's)
            nonlocal a2a_per_step
            before = topo.ledger.stats()
            yield
            if kind == "ep":
                a2a = topo.ledger.since(before).get(("ep", "all_to_all"))
                a2a_per_step = a2a.wire_bytes / steps if a2a else 0.0

        steppers = {kind: partial(_step, model, opt, x, y, world_size) for kind, (model, _, opt) in models.items()}
        times = interleaved_times(steppers, rounds, warmup, steps, around=count_all_to_all)
        mem = {kind: {"expert": _expert_bytes(core), "total": sum(p.numel() * 4 for p in core.parameters())}
               for kind, (_, core, _) in models.items()}
        return {"times": times, "mem": mem, "a2a": a2a_per_step}
    finally:
        topo.destroy()


def write_doc(rows: list[str], args, params: int) -> None:
    replace_section(DOC, "moe", "Mixture of experts: expert parallelism vs replicated experts under DDP", [
        f"Measured by `python benchmarks/moe.py` on {machine()} ({load_note()}). Model: `{args.preset}` ({params / 1e6:.2f}M "
        f"parameters; 2 MoE layers of 8 experts), top-{args.top_k}, capacity factor 1.25; per rank a batch of "
        f"{args.batch}×{args.seq} tokens; AdamW; {args.rounds} interleaved rounds of {args.warmup} warm-up + "
        f"{args.steps} timed steps. A = tessera expert parallelism with ep = ranks; B = the same MoE replicated "
        "under torch DDP. Step = median over a round on the slowest rank; ratio = median over rounds of A / B. "
        "Expert MiB = fp32 expert parameters held by one rank; all-to-all = ep-axis wire bytes per step and rank "
        "(forward dispatch + combine + counts, backward both inverses, 2 MoE layers). On CPU the ranks share "
        "2 cores, so the time shows relative cost only.",
        "",
        "| ranks = ep | EP step (s) | DDP step (s) | ratio EP/DDP | expert MiB/rank EP | expert MiB/rank DDP | "
        "DDP/EP memory | params MiB/rank EP / DDP | all-to-all MiB/step |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> None:
    parser = bench_parser(__doc__, ranks=[2, 4], preset="moe-small", batch=4, seq=128, rounds=4, steps=3,
                          warmup=1)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    params = model_config(args.preset).num_params()
    rows = []
    with pool_manager() as pools:
        for world in args.ranks:
            res = pools.run(bench_worker, world, timeout=3600.0, preset=args.preset, top_k=args.top_k,
                            batch=args.batch, seq=args.seq, rounds=args.rounds, steps=args.steps,
                            warmup=args.warmup)
            s, mem = ab_summary([r["times"] for r in res], "ep", "ddp"), res[0]["mem"]
            mib = lambda b: b / 2**20  # noqa: E731
            rows.append(
                f"| {world} | {statistics.median(s['ep']):.3f} | {statistics.median(s['ddp']):.3f} "
                f"| **{statistics.median(s['ratio']):.2f}** | {mib(mem['ep']['expert']):.2f} "
                f"| {mib(mem['ddp']['expert']):.2f} | **{mem['ddp']['expert'] / mem['ep']['expert']:.2f}×** "
                f"| {mib(mem['ep']['total']):.2f} / {mib(mem['ddp']['total']):.2f} "
                f"| {mib(max(r['a2a'] for r in res)):.2f} |")
            print(rows[-1], flush=True)
    if not args.no_write:
        write_doc(rows, args, params)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
