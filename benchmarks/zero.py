"""tessera ZeRO-1/2/3 against DeepSpeed ZeRO-1/2/3 and torch FSDP2 (``fully_shard``), with tessera DDP:
step time and model-state memory per rank, same model, same ranks, one invocation.

All variants live in the same gloo world, in the same processes, and run interleaved (A B C … A B C …)
over several rounds so the noise of a shared machine hits them alike. Every variant trains tessera's own
model from the same seed on the same batch; a step is forward + backward + global-norm clipping (1.0) +
torch AdamW (lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.1 on matrices and 0.0 on vectors), fp32.
FSDP2 and tessera ZeRO-3 use the same units (each transformer block, the embedding and the output head,
then the root). "offload" is tessera's ``zero.offload``, torch's ``CPUOffloadPolicy(pin_memory=False)`` and
DeepSpeed's ``offload_optimizer`` + ``offload_param`` (see _deepspeed.py for DeepSpeed's configuration).
Before timing, every variant's first-batch loss must equal DDP's, its first gradient norm (before clipping)
and its loss after one update must be within 1e-4 (relative) of DDP's: otherwise the script refuses to time unlike runs (one sentence, exit code 1).

Model state is counted outside the timed steps, in one extra step per variant after the rounds: the larger
of two snapshots (after backward, after the update) of the live tensors (storage-deduplicated, this rank's
local shards) holding parameters, gradients and optimizer state (fp32 masters and flat buffers included).

    python benchmarks/zero.py                      # 2 and 4 ranks, small preset, writes docs/BENCHMARKS.md
    python benchmarks/zero.py --ranks 2 --rounds 1 --steps 1 --warmup 1 --no-write   # smoke run

Needs DeepSpeed (the ``bench`` extra: ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _deepspeed  # noqa: E402  (sets DS_ACCELERATOR before anything imports deepspeed)
from _common import (DOCS, MIN_ROUNDS, bench_parser, interleaved_times, pool_manager, provenance,  # noqa: E402
                     replace_section, slowest_medians, spread, token_batch)

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
VARIANTS = ("ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2", "fsdp2_offload",
            "ds1", "ds2", "ds3", "ds3_offload", "ds3_default")  # the table's row order
# The order the variants run in within a round (rotated by one each round): each tessera variant next to the
# DeepSpeed and FSDP2 peers it is divided by, so that a round's ratio compares steps taken seconds apart
# rather than a dozen variants apart (this machine's speed drifts within a round)
RUN_ORDER = ("ddp", "zero1", "ds1", "zero2", "ds2", "zero3", "ds3", "fsdp2", "ds3_default", "zero3_offload",
             "ds3_offload", "fsdp2_offload")
# DeepSpeed ZeRO-3 variants that shard every parameter, as tessera's ZeRO-3 and FSDP2 do (equal model state);
# ds3_default keeps DeepSpeed's persistence threshold: parameters below 1e5 elements whole on every rank
DS_SHARD_ALL = ("ds3", "ds3_offload")
# Each tessera (and FSDP2) variant's DeepSpeed counterpart: the same ZeRO stage, offloading alike.
DS_PEER = {"zero1": "ds1", "zero2": "ds2", "zero3": "ds3", "zero3_offload": "ds3_offload",
           "fsdp2": "ds3", "fsdp2_offload": "ds3_offload"}
# FSDP2 is ZeRO-3: only the ZeRO-3 rows (tessera's and DeepSpeed's) are compared with it, offloading alike.
FSDP_PEER = {"zero3": "fsdp2", "zero3_offload": "fsdp2_offload", "ds3": "fsdp2", "ds3_offload": "fsdp2_offload",
             "ds3_default": "fsdp2"}
LOSS_RTOL = 1e-5  # first-batch losses of one model from one seed agree to fp32 summation-order noise
# after one AdamW update (whose first step moves every weight by about lr) the losses still agree closely;
# an optimizer configured differently (lr, decay, clipping) moves them by far more than this
SECOND_RTOL = 1e-4


class UnlikeRuns(RuntimeError):
    """The variants do not train the same model alike: their losses differ from DDP's."""


def _groups(params):
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.999), eps=1e-8)


class Variant:
    """A model plus how to step it and how to count its model-state bytes."""

    def __init__(self, kind: str, preset: str, topo: Topology, micro_batch: int):
        torch.manual_seed(0)
        core = Transformer(model_config(preset))
        self.kind, self.opt, self.loss, self.grad_norm = kind, None, None, None
        # tessera's ZeRO reduces by sum and takes the mean from the loss (its trainer divides the summed
        # token loss by the global token count): 1/N here, so every variant steps with the same mean gradient
        self.loss_weight = 1.0 / topo.size("dp") if kind.startswith("zero") else 1.0
        offload = kind.endswith("offload")
        if kind == "ddp":
            self.model = DistributedDataParallel(core, topo.group("dp"), reduce_op="avg")
            self.opt = _adamw(_groups(core.parameters()))
        elif kind.startswith("zero"):
            self.model = shard_model(core, _groups(core.parameters()), _adamw, topo, int(kind[4]),
                                     ZeroConfig(offload=offload), PrecisionConfig(), torch.device("cpu"),
                                     block_class=TransformerBlock)
        elif kind.startswith("ds"):
            self.model = _deepspeed.build_engine(core, _groups(core.parameters()), _adamw, int(kind[2]),
                                                 offload, micro_batch, 0 if kind in DS_SHARD_ALL else None)
        else:
            self.model = self._fsdp2(core, topo, offload)
            self.opt = _adamw(_groups(self.model.parameters()))

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

    def forward_backward(self, x, y) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        if self.kind.startswith("ds"):
            self.model.backward(loss)
        else:
            (loss * self.loss_weight if self.loss_weight != 1.0 else loss).backward()
        return loss.detach()

    def update(self) -> None:
        """Clip at 1.0 and step; DeepSpeed's ``step()`` clips, steps and clears its gradients."""
        if self.kind.startswith(("zero", "ds")):
            if self.kind.startswith("zero"):
                self.grad_norm = self.model.clip_grad_norm(1.0)[0]
            self.model.step()
            if self.kind.startswith("ds"):
                self.grad_norm = self.model.get_global_grad_norm()
            return
        params = list(self.model.parameters())
        if self.kind == "ddp":
            self.grad_norm = clip_grad_norm(params, {}, 1.0)  # DDP: gradients replicated, no norm axes
        else:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)  # a DTensor: read in check_losses
        self.opt.step()

    def zero_grad(self) -> None:
        if self.kind.startswith("zero"):
            self.model.zero_grad()
        elif self.opt is not None:
            self.opt.zero_grad(set_to_none=True)

    def step(self, x, y) -> float:
        """One timed training step; nothing is measured inside it but the time."""
        t0 = time.perf_counter()
        loss = self.forward_backward(x, y)
        self.update()
        self.zero_grad()
        seconds = time.perf_counter() - t0
        self.loss = loss.item()
        return seconds

    def measure_state(self, x, y) -> int:
        """One untimed step: model-state bytes after backward and after the update, the larger kept."""
        self.forward_backward(x, y)
        after_backward = self.state_bytes()
        self.update()
        after_update = self.state_bytes()
        self.zero_grad()
        return max(after_backward, after_update)

    def state_bytes(self) -> int:
        if self.kind.startswith("zero"):
            held = self.model.memory_tensors()
            return sum(storage_bytes(held[k]) for k in ("params", "grads", "optimizer"))
        if self.kind.startswith("ds"):
            return storage_bytes(_deepspeed.held_tensors(self.model))
        return storage_bytes(getattr(t, "_local_tensor", t) for t in self._fsdp_or_ddp_tensors())

    def _fsdp_or_ddp_tensors(self):
        for p in self.model.parameters():
            yield p
            yield p.grad
        if self.kind == "ddp":
            yield from self.model.grad_buffers
        for st in self.opt.state.values():
            yield from (v for v in st.values() if isinstance(v, torch.Tensor))


def check_losses(variants: list[Variant], x, y) -> dict[str, list[float]]:
    """Two steps of every variant (they double as warm-up): the first-batch losses must equal DDP's
    (LOSS_RTOL), or the variants do not train the same model on the same batch, and the losses after one
    update must be within SECOND_RTOL of DDP's, or the optimizers differ. Returns each variant's two
    losses; raises UnlikeRuns otherwise."""
    losses, norms = {}, {}
    for v in variants:
        losses[v.kind] = []
        for _ in range(2):
            v.step(x, y)
            losses[v.kind].append(v.loss)
            norms.setdefault(v.kind, _as_float(v.grad_norm))  # the first step's, before clipping
    ref = norms["ddp"]
    unlike = {k: n for k, n in norms.items() if not math.isclose(n, ref, rel_tol=SECOND_RTOL)}
    if unlike:  # a gradient summed where the others average, or clipped differently, shows here
        raise UnlikeRuns(f"first-step gradient norms differ from DDP's {ref:.6f} by more than {SECOND_RTOL:g} "
                         f"(relative): {unlike}")
    for step, (when, rtol) in enumerate((("first-batch", LOSS_RTOL), ("after-one-update", SECOND_RTOL))):
        ref = losses["ddp"][step]
        unlike = {k: l[step] for k, l in losses.items() if not math.isclose(l[step], ref, rel_tol=rtol)}
        if unlike:
            raise UnlikeRuns(f"{when} losses differ from DDP's {ref:.6f} by more than {rtol:g} (relative): "
                             f"{unlike}")
    return losses


def _as_float(norm) -> float:
    """A gradient norm as a float: FSDP2's is a DTensor, DeepSpeed's a tensor or a float."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank of the default group: the timing is collective, so every rank
    must refuse together."""
    import torch.distributed as dist

    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def bench_worker(rank, world_size, preset, batch, seq, rounds, steps, warmup):
    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size))
    try:
        variants = [Variant(kind, preset, topo, batch) for kind in VARIANTS]
        x, y = token_batch(rank, batch, seq)
        try:
            losses, refused = check_losses(variants, x, y), ""
        except UnlikeRuns as e:
            losses, refused = None, str(e)
        if any_rank(bool(refused)):
            return {"refused": refused or "another rank's losses differ from DDP's"}
        by_kind = {v.kind: v for v in variants}
        times = interleaved_times({k: partial(by_kind[k].step, x, y) for k in RUN_ORDER}, rounds, warmup, steps)
        state = {v.kind: v.measure_state(x, y) for v in variants}
        return {"times": times, "state": state, "losses": losses}
    finally:
        topo.destroy()


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_worker(rank, world_size, kind, preset, batch, seq, steps):
    """In a fresh process: peak RSS growth from just before building ``kind`` through ``steps`` steps (the
    libraries are imported before the baseline: their code is not model memory)."""
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    from tessera.train.memory import peak_rss_bytes

    if kind.startswith("ds"):
        import deepspeed  # noqa: F401
    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size))
    try:
        before = _rss_bytes()
        variant = Variant(kind, preset, topo, batch)
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
    """Per variant: median over rounds of the slowest rank's median step; per-round ratios against its
    DeepSpeed peer, FSDP2 and DDP (lists, one per round); the largest model-state bytes of any rank."""
    per_round = {k: slowest_medians([r["times"][k] for r in results]) for k in VARIANTS}

    def ratios(k, base):
        return [a / b for a, b in zip(per_round[k], per_round[base])] if base else None

    return {k: {"step": statistics.median(per_round[k]), "vs_ds": ratios(k, DS_PEER.get(k)),
                "vs_fsdp2": ratios(k, FSDP_PEER.get(k)),
                "vs_ddp": ratios(k, "ddp"), "state": max(r["state"][k] for r in results)}
            for k in VARIANTS}


def rows_for(world: int, s: dict, peaks: dict[str, int]) -> list[str]:
    rows = []
    for k in VARIANTS:
        peer = DS_PEER.get(k)
        mem_ds = f"{s[k]['state'] / s[peer]['state']:.3f}" if peer else "—"
        vs_ds = spread(s[k]["vs_ds"]) if peer else "—"
        vs_fsdp2 = spread(s[k]["vs_fsdp2"]) if k in FSDP_PEER else "—"
        rows.append(f"| {world} | {k} | {s[k]['step']:.4f} | {vs_ds} | {vs_fsdp2} "
                    f"| {spread(s[k]['vs_ddp'])} | {s[k]['state'] / 2**20:.2f} | {mem_ds} "
                    f"| {peaks[k] / 2**20:.1f} |")
    return rows


def loss_note(results_by_world: dict[int, list[dict]]) -> str:
    """The checks every run passed, and how far the losses after one identical update measured from DDP's."""
    worst = max(abs(l[1] / r["losses"]["ddp"][1] - 1) for res in results_by_world.values() for r in res
                for l in r["losses"].values())
    return (f"Checked in every run before timing: each variant's first-batch loss equals DDP's (relative "
            f"{LOSS_RTOL:g}), its gradient norm before the first clipping is within {SECOND_RTOL:g} of DDP's (the "
            f"same mean gradient: tessera's ZeRO takes the mean from the loss, 1/N, and reduces by sum) and its "
            f"loss after one update is within {SECOND_RTOL:g} of DDP's; measured, the "
            f"largest difference after one update was {worst:.1e} (relative).")


def write_doc(rows: list[str], args, params: int, note: str) -> None:
    bucket_mib = _deepspeed.BUCKET_ELEMENTS * 4 / 2**20
    replace_section(DOC, "zero", "ZeRO-1/2/3 vs DeepSpeed, torch FSDP2 and DDP (CPU, gloo)", [
        f"{provenance()} Model: `{args.preset}` preset ({params / 1e6:.2f}M parameters), fp32, torch AdamW "
        f"(lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.1 on matrices, 0.0 on vectors), clipping "
        f"at 1.0; per rank a batch of {args.batch}×{args.seq} tokens; {args.rounds} interleaved rounds of "
        f"{args.warmup} warm-up + {args.steps} timed steps per variant, in the order "
        f"{', '.join(RUN_ORDER)} (each tessera variant next to its peers), rotated by one variant each round. "
        f"{note}",
        "",
        "Step = median over rounds of the slowest rank's median step. Every ratio is the median of the "
        "per-round ratios with their min–max. ÷ DeepSpeed compares with the same ZeRO stage "
        "(zero1↔ds1, zero2↔ds2, zero3↔ds3, zero3_offload↔ds3_offload; FSDP2 with ds3 and its offload "
        "with ds3_offload). FSDP2 is ZeRO-3, so ÷ FSDP2 is given for the ZeRO-3 rows only (zero3 and ds3 "
        "÷ fsdp2, zero3_offload and ds3_offload ÷ fsdp2_offload) and is — elsewhere. ds3 and ds3_offload shard "
        "every parameter (`stage3_param_persistence_threshold: 0`), as tessera's ZeRO-3 and FSDP2 do: the same "
        "model state, the like-for-like peer; ds3_default keeps DeepSpeed's threshold of 1e5 elements, below "
        "which a parameter stays whole on every rank (at this model's width every attention matrix and norm: "
        "fewer, smaller gathers for more model state, see its model-state column), shown for reference. "
        "DeepSpeed runs its engine "
        "in fp32 with the same torch AdamW passed as its optimizer (also under offload: "
        "`zero_force_ds_cpu_optimizer: false`, not DeepSpeedCPUAdam, like tessera's `zero.offload` and "
        "FSDP2's CPU offload, which step torch AdamW on the host), `gradient_clipping: 1.0`, "
        f"`reduce_bucket_size` (and `allgather_bucket_size` for stages 1–2) = tessera's {bucket_mib:.0f} MiB "
        "bucket cap, capped at the model's size as tessera's buckets are (DeepSpeed allocates its reduce "
        "bucket at full size; its 5e8-element default would be 2 GB); everything else at DeepSpeed's "
        "defaults (contiguous_gradients and reduce_scatter on; overlap_comm on for ZeRO-3 only; ZeRO-3: "
        "stage3_prefetch_bucket_size 5e7, stage3_max_live_parameters 1e9). ds3_offload sets "
        "`offload_optimizer` and `offload_param` to cpu.",
        "",
        "Model state = the larger of two snapshots, after backward and after the update, taken in one "
        "untimed step after the rounds: parameters + gradients + optimizer state (fp32 masters included) "
        "held by the rank, counted from live tensors, storage-deduplicated (largest rank). For DeepSpeed: "
        "the module's parameters and gradients (ZeRO-3: each parameter's local partition `ds_tensor` and "
        "its persistent parameters), every tensor its ZeRO optimizer keeps in its attributes (flat "
        "parameter groups, fp32 partitions, gradient buckets and partitions, offload buffers) and the "
        "inner AdamW's state. Peak = growth of the process's peak resident memory from just before the "
        "model is built (libraries already imported) through 2 steps, each variant alone in a freshly "
        "started process per rank (largest rank; includes allocator and library overheads).",
        "",
        "Stage 1 on both sides reduces the gradients once per step and then keeps only the rank's reduced "
        "slice: tessera's ZeRO-1 adds each bucket's reduced slice into a partition-sized gradient and frees "
        "the full buffers at the end of the backward; DeepSpeed's stage 1 (default contiguous_gradients) "
        "copies the reduced gradients of its partition into a partition-sized buffer and keeps the rest only "
        "in its reused reduce bucket.",
        "",
        "On gloo (these CPU runs) the collectives differ by implementation, not by what they compute: gloo "
        "has no reduce-scatter of its own (torch's `reduce_scatter_tensor` all-reduces a clone of the input "
        "and copies out the slice) and its all-gather collects into a buffer of its own before copying into "
        "the output. tessera runs a reduce-scatter of a gradient it drops afterwards as an all-reduce in "
        "that gradient plus a copy of the slice, and an all-gather of 1 MiB or more as one broadcast per "
        "rank straight into the output (`tessera.comm.gloo`; the same bits). DeepSpeed stages 1–2 "
        "all-reduce their reduce bucket (its default `use_multi_rank_bucket_allreduce`) and all-gather the "
        "updated partitions with torch's call; FSDP2 and DeepSpeed stage 3 use torch's reduce-scatter and "
        "all-gather.",
        "",
        "Target: tessera ÷ DeepSpeed ≤ 1.00 at the same ZeRO stage, and on the ZeRO-3 rows tessera ÷ FSDP2 "
        "≤ 1.00, each at equal or lower model-state bytes.",
        "",
        "| ranks | variant | step (s) | ÷ DeepSpeed | ÷ FSDP2 | ÷ DDP | model state per rank (MiB) "
        "| memory ÷ DeepSpeed | peak RSS growth per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> None:
    args = bench_parser(__doc__, ranks=[2, 4], preset="small", batch=8, seq=128, rounds=MIN_ROUNDS, steps=3,
                        warmup=1).parse_args()
    if not _deepspeed.available():
        print("zero.py: error: DeepSpeed is not installed; install the bench extra (pip install -e '.[bench]').",
              file=sys.stderr)
        sys.exit(2)
    _deepspeed.build_ops()  # once, here, before any rank starts
    params = model_config(args.preset).num_params()
    rows, results = [], {}
    with pool_manager() as pools:
        for world in args.ranks:
            results[world] = pools.run(bench_worker, world, timeout=3600.0, preset=args.preset,
                                       batch=args.batch, seq=args.seq, rounds=args.rounds, steps=args.steps,
                                       warmup=args.warmup)
            refused = [r["refused"] for r in results[world] if "refused" in r]
            if refused:
                print(f"zero.py: error: not timing unlike runs on {world} ranks: {refused[0]}.", file=sys.stderr)
                sys.exit(1)
            rows += rows_for(world, summarize(results[world]), peak_growth(world, args))
            print("\n".join(rows[-len(VARIANTS):]), flush=True)
    note = loss_note(results)
    print(note)
    if not args.no_write:
        write_doc(rows, args, params, note)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
