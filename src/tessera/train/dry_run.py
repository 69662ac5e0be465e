"""``tessera train --dry-run``: what a job would be, printed after every check a launch makes, with
nothing started (no rank, no process group) and nothing written.

It shows the resolved layout (after ``parallel.auto``), the run folder, the checkpoint it would resume
from, each rank's role — its coordinate on every axis, from :meth:`tessera.topology.Topology.layout`,
the same pure function the ranks build their groups from — and the planner's predicted memory per rank,
which differs only by pipeline stage (tp, ep and ZeRO split a stage evenly).
"""

from __future__ import annotations

from pathlib import Path

from tessera.planner import Layout, from_model_config
from tessera.planner.estimate import stage_memory
from tessera.planner.memory import offload_kind
from tessera.topology import GRID_AXES, ParallelConfig, Topology

SHOWN_RANKS = 64  # larger worlds print the first and last half of this many ranks
KINDS = ("params", "grads", "optimizer", "activations", "buffers", "total")


def planner_layout(cfg, par: ParallelConfig) -> tuple[Layout, int, list[str]]:
    """The planner's view of the job: (layout, global batch it sees, notes on what it approximates)."""
    notes, batch, dp = [], cfg.data.global_batch_size, par.dp_replicate * par.dp_shard
    if par.zero_stage > 0 and par.dp_shard > 1 and par.dp_replicate > 1:
        # hybrid sharding: state shards over dp_shard only; the planner's dp is that group (same micro-batches)
        dp, batch = par.dp_shard, batch // par.dp_replicate
    micro, schedule, virtual = cfg.data.micro_batch_size, "none", 1
    if par.pp > 1:
        per_rank = cfg.data.global_batch_size // (par.dp_replicate * par.dp_shard)
        micro = per_rank // (1 if cfg.pipeline.schedule == "naive" else cfg.pipeline.microbatches)
        schedule = {"naive": "gpipe", "pipedream": "1f1b", "2bw": "1f1b"}.get(cfg.pipeline.schedule,
                                                                              cfg.pipeline.schedule)
        virtual = cfg.pipeline.virtual_stages
        if cfg.pipeline.schedule in ("pipedream", "2bw"):
            notes.append(f"{cfg.pipeline.schedule}: counted as 1F1B; its stashed weight versions are not included")
    if cfg.checkpointing.mode != "none" and cfg.checkpointing.every > 1:
        notes.append(f"checkpointing.every={cfg.checkpointing.every}: counted as if every block were checkpointed")
    if par.zero_stage == 3 and not cfg.zero.reshard_after_forward:
        notes.append("zero.reshard_after_forward=false: units stay gathered from forward to backward, "
                     "which is not counted (the planner counts two gathered units)")
    if cfg.model.num_experts and par.tp > 1:
        notes.append("experts are replicated over tp here; the planner splits them over tp")
    layout = Layout(dp=dp, zero_stage=par.zero_stage, pp=par.pp, tp=par.tp,
                    sp=cfg.tensor_parallel.sequence_parallel and par.tp > 1, cp=par.cp, ep=par.ep,
                    micro_batch=micro, recompute=cfg.checkpointing.mode, offload=_offload(cfg.zero.offload),
                    schedule=schedule, virtual_stages=virtual)
    return layout, batch, notes


def _offload(value):
    """``zero.offload`` as a Layout's ``offload``: False, True (host memory) or "disk"."""
    return {"none": False, "host": True, "disk": "disk"}[offload_kind(value)]


def predicted_memory(cfg, par: ParallelConfig) -> tuple[list[dict], list[str]]:
    """Predicted bytes of one rank of each pipeline stage (list index = stage), by kind, and the planner's
    notes."""
    layout, batch, notes = planner_layout(cfg, par)
    spec = from_model_config(cfg.model_preset, cfg.model, top_k=cfg.moe.top_k, lora=cfg.lora)
    precision = "fp32" if cfg.precision.dtype == "fp32" else "mixed"
    memory = [stage_memory(spec, layout, batch, cfg.data.seq_len, precision, "adam", stage)[0]
              for stage in range(layout.pp)]
    return memory, notes


def rank_roles(par: ParallelConfig) -> tuple[tuple[str, ...], list[tuple[int, ...]]]:
    """(axis names, one row of coordinates per global rank): pp, dp_replicate, dp_shard, cp, tp, and
    ep / edp when experts are sharded. A coordinate is the rank's position in its group of that axis."""
    axes = (*GRID_AXES, *(("ep", "edp") if par.ep > 1 else ()))
    parts = Topology.layout(par)
    world = len(parts["world"][0])
    coords = {axis: [0] * world for axis in axes}
    for axis in axes:
        for group in parts[axis]:
            for position, rank in enumerate(group):
                coords[axis][rank] = position
    return axes, [tuple(coords[a][r] for a in axes) for r in range(world)]


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def _unit(totals: list[float]) -> tuple[str, float]:
    return ("GB", 1e9) if max(totals, default=0.0) >= 1e9 else ("MB", 1e6)


def _memory_table(memory: list[dict]) -> list[str]:
    name, div = _unit([m["total"] for m in memory])
    lines = [f"  {'stage':>5}" + "".join(f"  {k:>11}" for k in KINDS)]
    lines += [f"  {s:>5}" + "".join(f"  {m[k] / div:>11.2f}" for k in KINDS) for s, m in enumerate(memory)]
    return [f"predicted memory per rank ({name}, planner; every rank of a stage alike):", *lines]


def _rank_table(par: ParallelConfig, memory: list[dict]) -> list[str]:
    axes, rows = rank_roles(par)
    name, div = _unit([m["total"] for m in memory])
    pp_at = axes.index("pp")
    head = "  " + "  ".join(f"{c:>{max(len(c), 4)}}" for c in ("rank", *axes, name))
    widths = [max(len(c), 4) for c in ("rank", *axes)]

    def line(rank: int, row: tuple[int, ...]) -> str:
        cells = [f"{v:>{w}}" for v, w in zip((rank, *row), widths)]
        return "  " + "  ".join(cells) + f"  {memory[row[pp_at]]['total'] / div:>{len(name) + 2}.2f}"

    shown = range(len(rows))
    if len(rows) > SHOWN_RANKS:
        half = SHOWN_RANKS // 2
        shown = [*range(half), None, *range(len(rows) - half, len(rows))]
    body = [line(r, rows[r]) if r is not None else f"  … {len(rows) - SHOWN_RANKS} more ranks" for r in shown]
    return ["ranks (coordinate on each axis; memory of the rank's pipeline stage):", head, *body]


def describe_job(cfg, par: ParallelConfig, world: int, run_dir: Path, resume: Path | None,
                 memory_check: str = "") -> str:
    """The dry-run report of a collective-training job resolved to ``par`` on ``world`` ranks;
    ``memory_check``: the verdict of the memory check before launch (``tessera.train.memory_check``)."""
    m = cfg.model
    degrees = " ".join(f"{a}={getattr(par, a)}" for a in (*GRID_AXES, "ep") if getattr(par, a) > 1) or "one process"
    pipeline = (f", pipeline {cfg.pipeline.schedule} with {cfg.pipeline.microbatches} micro-batches"
                if par.pp > 1 else "")
    memory, notes = predicted_memory(cfg, par)
    lines = [
        "tessera train --dry-run: every check passed; nothing was started and nothing written",
        f"model:      {cfg.model_preset}{f' ({cfg.model_hf})' if cfg.model_hf else ''}, "
        f"{_count(m.num_params(moe=cfg.moe))} parameters "
        f"({m.n_layers} layers, dim {m.dim}{f', {m.num_experts} experts' if m.num_experts else ''}), "
        f"{cfg.precision.dtype}",
        f"data:       {cfg.data.global_batch_size} sequences x {cfg.data.seq_len} tokens per step "
        f"(micro-batch {cfg.data.micro_batch_size}), {cfg.train.steps} steps, corpus {cfg.data.corpus}",
        f"layout:     {world} rank(s): {degrees}; zero_stage={par.zero_stage}; order {par.order}{pipeline}",
        f"run folder: {run_dir}",
        f"resume:     {resume if resume is not None else 'none (a fresh start)'}",
        "", *_memory_table(memory), *(f"  note: {n}" for n in notes), *([memory_check] if memory_check else []),
        "", *_rank_table(par, memory),
    ]
    return "\n".join(lines)


def describe_ctr_job(cfg, out_dir: Path) -> str:
    """The dry-run report of a parameter-server job (model.preset = "ctr"), whose run folder goes into
    ``out_dir``."""
    ps = cfg.ps
    return "\n".join([
        "tessera train --dry-run: every check passed; nothing was started and nothing written",
        f"parameter-server job: {ps.servers} server(s) and {ps.workers} worker(s), {ps.mode}"
        f"{f' (staleness {ps.staleness})' if ps.mode == 'ssp' else ''}, {cfg.train.steps} steps of "
        f"{ps.batch_size} samples per worker, optimizer {ps.optimizer}",
        f"run folder: a new folder in {out_dir} (named by run.name, or after the job)",
    ])
