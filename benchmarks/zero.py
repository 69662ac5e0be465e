"""tessera ZeRO-1/2/3 against torch FSDP2 (``fully_shard``) and tessera DDP: step time and model-state
memory per rank, same model, same ranks, one invocation.

All variants live in the same gloo world, in the same processes, and run interleaved (A B C … A B C …)
over several rounds so the noise of a shared machine hits them alike. A step is forward + backward +
global-norm clipping (1.0) + AdamW. FSDP2 and tessera ZeRO-3 use the same units (each transformer
block, the embedding and the output head, then the root); "offload" is torch's
``CPUOffloadPolicy(pin_memory=False)`` and tessera's ``zero.offload``.

Memory is counted from live tensors after the update (storage-deduplicated, this rank's local shards
for FSDP2's DTensors): parameters + gradients + optimizer state (fp32 masters included). The process's
peak RSS cannot be told apart between variants that share a process, so it is not reported here.

    python benchmarks/zero.py                      # 2 and 4 ranks, small preset, writes docs/BENCHMARKS.md
    python benchmarks/zero.py --ranks 2 --rounds 2 --no-write
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (DOCS, bench_parser, command_line, interleaved_times, machine, pool_manager,  # noqa: E402
                     replace_section, slowest_medians, token_batch)

from tessera.data_parallel import DistributedDataParallel  # noqa: E402
from tessera.grad_norm import clip_grad_norm  # noqa: E402
from tessera.models import Transformer, model_config  # noqa: E402
from tessera.models.layers import TransformerBlock  # noqa: E402
from tessera.precision import PrecisionConfig  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402
from tessera.train.memory import storage_bytes  # noqa: E402
from tessera.zero import ZeroConfig  # noqa: E402
from tessera.zero.build import shard_model  # noqa: E402

DOC = DOCS / "BENCHMARKS.md"
VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "zero3_offload", "fsdp2_offload")


def _groups(params):
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-4)


class Variant:
    """A model plus how to step it and how to count its model-state bytes."""

    def __init__(self, kind: str, preset: str, topo: Topology):
        torch.manual_seed(0)
        core = Transformer(model_config(preset))
        self.kind = kind
        if kind == "ddp":
            self.model = DistributedDataParallel(core, topo.group("dp"), reduce_op="avg")
            self.opt = _adamw(_groups(core.parameters()))
        elif kind.startswith("zero"):
            stage = int(kind[4])
            self.model = shard_model(core, _groups(core.parameters()), _adamw, topo, stage,
                                     ZeroConfig(offload=kind.endswith("offload")), PrecisionConfig(),
                                     torch.device("cpu"), block_class=TransformerBlock)
        else:
            self.model = self._fsdp2(core, topo, kind.endswith("offload"))
            self.opt = _adamw(_groups(self.model.parameters()))
        self.core = core

    @staticmethod
    def _fsdp2(core, topo, offload):
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = topo.device_mesh("cpu")
        extra = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
        for block in core.layers.values():
            fully_shard(block, mesh=mesh, **extra)
        fully_shard(core.tok_embeddings, mesh=mesh, **extra)
        fully_shard(core.output, mesh=mesh, **extra)
        return fully_shard(core, mesh=mesh, **extra)

    def step(self, x, y) -> float:
        t0 = time.perf_counter()
        logits = self.model(x)
        nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        if self.kind.startswith("zero"):
            self.model.clip_grad_norm(1.0)
            self.model.step()
            self.snapshot()
            self.model.zero_grad()
        else:
            params = list(self.model.parameters())
            if self.kind == "ddp":
                clip_grad_norm(params, {}, 1.0)  # DDP: gradients replicated, no norm axes
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            self.opt.step()
            self.snapshot()
            self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def snapshot(self) -> None:
        """Model-state bytes this rank holds right after the update (gradients still alive)."""
        if self.kind.startswith("zero"):
            held = self.model.memory_tensors()
            self.state = sum(storage_bytes(held[k]) for k in ("params", "grads", "optimizer"))
            return
        local = [getattr(t, "_local_tensor", t) for t in self._fsdp_or_ddp_tensors()]
        self.state = storage_bytes(local)

    def _fsdp_or_ddp_tensors(self):
        for p in self.model.parameters():
            yield p
            yield p.grad
        if self.kind == "ddp":
            yield from self.model.grad_buffers
        for st in self.opt.state.values():
            yield from (v for v in st.values() if isinstance(v, torch.Tensor))


def bench_worker(rank, world_size, preset, batch, seq, rounds, steps, warmup):
    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size))
    try:
        variants = [Variant(kind, preset, topo) for kind in VARIANTS]
        x, y = token_batch(rank, batch, seq)
        times = interleaved_times({v.kind: partial(v.step, x, y) for v in variants}, rounds, warmup, steps)
        return {"times": times, "state": {v.kind: v.state for v in variants}}
    finally:
        topo.destroy()


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_worker(rank, world_size, kind, preset, batch, seq, steps):
    """In a fresh process: peak RSS growth from just before building ``kind`` through ``steps`` steps."""
    from tessera.train.memory import peak_rss_bytes

    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size))
    try:
        before = _rss_bytes()
        variant = Variant(kind, preset, topo)
        x, y = token_batch(rank, batch, seq)
        for _ in range(steps):
            variant.step(x, y)
        return peak_rss_bytes() - before
    finally:
        topo.destroy()


def peak_growth(world: int, args) -> dict[str, int]:
    """Largest rank's peak RSS growth per variant, each measured in a freshly started pool (ru_maxrss
    never goes down, so variants sharing a process could not be told apart)."""
    out = {}
    for kind in VARIANTS:
        with pool_manager() as pools:
            out[kind] = max(pools.run(peak_worker, world, timeout=1800.0, kind=kind, preset=args.preset,
                                      batch=args.batch, seq=args.seq, steps=2))
    return out


def summarize(results: list[dict]) -> dict[str, dict]:
    """Per variant: median over rounds of the slowest rank's median step, its ratios against FSDP2 and
    DDP (per round, then the median), and the largest model-state bytes of any rank."""
    per_round = {k: slowest_medians([r["times"][k] for r in results]) for k in VARIANTS}
    out = {}
    for k in VARIANTS:
        base = "fsdp2_offload" if k.endswith("offload") else "fsdp2"
        out[k] = {
            "step": statistics.median(per_round[k]),
            "vs_fsdp2": statistics.median(a / b for a, b in zip(per_round[k], per_round[base])),
            "vs_ddp": statistics.median(a / b for a, b in zip(per_round[k], per_round["ddp"])),
            "state": max(r["state"][k] for r in results),
        }
    return out


def rows_for(world: int, s: dict, peaks: dict[str, int]) -> list[str]:
    rows = []
    for k in VARIANTS:
        base = "fsdp2_offload" if k.endswith("offload") else "fsdp2"
        mem = s[k]["state"] / s[base]["state"]
        rows.append(f"| {world} | {k} | {s[k]['step']:.4f} | {s[k]['vs_fsdp2']:.3f} | {s[k]['vs_ddp']:.3f} "
                    f"| {s[k]['state'] / 2**20:.2f} | {mem:.3f} | {peaks[k] / 2**20:.1f} |")
    return rows


def write_doc(rows: list[str], args, params: int, load: str) -> None:
    replace_section(DOC, "zero", "ZeRO-1/2/3 vs torch FSDP2 and DDP (CPU, gloo)", [
        f"Measured by `{command_line()}` on {machine()}; {load}. Model: `{args.preset}` preset "
        f"({params / 1e6:.2f}M parameters), fp32, AdamW, clipping at 1.0; per rank a batch of "
        f"{args.batch}×{args.seq} tokens; {args.rounds} interleaved rounds of {args.warmup} warm-up + "
        f"{args.steps} timed steps per variant. Step = median over rounds of the slowest rank's median; "
        "ratios are per-round ratios, medianed; the offload variants are compared with FSDP2 offload. "
        "Model state = parameters + gradients + optimizer state (fp32 masters included) held by the rank "
        "after the update, counted from live tensors (largest rank). Peak = growth of the process's peak "
        "resident memory from just before the model is built through 2 steps, each variant alone in a "
        "freshly started process per rank (largest rank; includes allocator and library overheads). "
        "Target: zero3 ≤ 1.1× fsdp2 at equal or lower memory.",
        "",
        "| ranks | variant | step (s) | ÷ FSDP2 | ÷ DDP | model state per rank (MiB) | memory ÷ FSDP2 "
        "| peak RSS growth per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> None:
    import os

    args = bench_parser(__doc__, ranks=[2, 4], preset="small", batch=8, seq=128, rounds=3, steps=3,
                        warmup=1).parse_args()
    params = model_config(args.preset).num_params()
    load_before = os.getloadavg()[0]
    rows = []
    with pool_manager() as pools:
        for world in args.ranks:
            results = pools.run(bench_worker, world, timeout=3600.0, preset=args.preset, batch=args.batch,
                                seq=args.seq, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
            rows += rows_for(world, summarize(results), peak_growth(world, args))
            print("\n".join(rows[-len(VARIANTS):]), flush=True)
    load = (f"1-minute load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after the run on "
            f"{os.cpu_count()} cores")
    print(load)
    if not args.no_write:
        write_doc(rows, args, params, load)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
