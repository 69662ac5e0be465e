"""Search: enumerate the layouts of a model on a cluster, drop those over memory and (given the trainer's
rule, tessera.planner.trainable) those ``tessera train`` refuses, rank the rest by step time."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tessera.errors import ConfigError, UserError
from tessera.planner.estimate import estimate, memory_per_rank
from tessera.planner.layout import Layout

GB = 1e9
MICRO_BATCHES = (1, 2, 4, 8)
CONTEXT_DEGREES = (1, 2, 4, 8)
RECOMPUTES = ("none", "selective", "full")


class NoLayoutFits(UserError):
    """Every valid layout needs more memory than the GPU has (an answer, not bad input: exit code 1)."""

    exit_code = 1


@dataclass
class SearchSpace:
    """Which features the search may use (restrict it to what an implementation supports)."""

    tp: bool = True
    sp: bool = True
    pp: bool = True
    cp: bool = True
    zero_stages: tuple = (0, 1, 2, 3)
    recompute: tuple = RECOMPUTES
    offload: bool = True
    offload_to: tuple = (True,)  # an offloading layout's ``offload``: True (host memory) and/or "disk"
    # GPipe has 1F1B's bubble and holds more micro-batches, so it never wins; name it here to compare.
    schedules: tuple = ("1f1b", "interleaved", "zb-h1")
    micro_batches: tuple = MICRO_BATCHES


@dataclass
class Plan:
    ranked: list  # Estimates that fit (and, given a rule, that the trainer runs), fastest first
    considered: int  # layouts that divide the model, cluster and batch
    fitting: int = 0  # of those, how many fit in memory (before the trainer's rule)
    refused: list = field(default_factory=list)  # (Layout, reason): fitting layouts the rule refused while ranking


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _grids(spec, gpus: int, gpus_per_node: int, seq: int, space: SearchSpace):
    """(tp, pp, cp, dp) whose product is ``gpus`` and that divide the model's shapes."""
    for tp in _divisors(gpus) if space.tp else [1]:
        if tp > gpus_per_node or spec.heads % tp or spec.ffn % tp or (spec.kv_heads % tp and tp % spec.kv_heads):
            continue
        for pp in _divisors(gpus // tp) if space.pp else [1]:
            if spec.layers % pp:
                continue
            for cp in CONTEXT_DEGREES if space.cp else (1,):
                if (gpus // (tp * pp)) % cp or seq % cp:
                    continue
                yield tp, pp, cp, gpus // (tp * pp * cp)


def _schedules(spec, pp: int, m: int, space: SearchSpace):
    if pp == 1:
        yield "none", 1
        return
    for name in space.schedules:
        if name == "gpipe":
            yield name, 1
        elif name in ("1f1b", "zb-h1") and m >= pp:
            yield name, 1
        elif name == "interleaved" and m % pp == 0 and spec.layers % (2 * pp) == 0:
            yield name, 2


def enumerate_layouts(spec, gpus: int, global_batch: int, seq: int, gpus_per_node: int = 8,
                      space: SearchSpace | None = None):
    """Every layout that divides ``gpus``, the model's heads/layers/sequence and the global batch."""
    space = space or SearchSpace()
    for tp, pp, cp, dp in _grids(spec, gpus, gpus_per_node, seq, space):
        eps = [e for e in _divisors(dp) if spec.experts % e == 0] if spec.experts > 1 else [1]
        sps = (False, True) if tp > 1 and space.sp else (False,)
        zeros = [z for z in space.zero_stages if z == 0 or dp * cp > 1]
        for mb in space.micro_batches:
            if global_batch % (dp * mb):
                continue
            m = global_batch // (dp * mb)
            for (sched, v), ep, sp, zero, rc in itertools.product(
                    list(_schedules(spec, pp, m, space)), eps, sps, zeros, space.recompute):
                for off in ((False, *space.offload_to) if space.offload and zero >= 1 else (False,)):
                    yield Layout(dp=dp, zero_stage=zero, pp=pp, tp=tp, sp=sp, cp=cp, ep=ep, micro_batch=mb,
                                 recompute=rc, offload=off, schedule=sched, virtual_stages=v)


def check_request(spec, gpu, gpus: int, global_batch: int, seq: int) -> None:
    """ConfigError (one sentence) for numbers no layout could use."""
    for name, value in (("--gpus", gpus), ("--global-batch", global_batch), ("--seq", seq)):
        if value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value}")


def search(spec, gpu, gpus: int, global_batch: int, seq: int | None = None, *, precision: str = "mixed",
           optimizer: str = "adam", space: SearchSpace | None = None, top: int | None = None,
           rule=None, host_counts: bool = False) -> Plan:
    """Rank every fitting layout by predicted step time. ``rule(layout) -> reason | None`` (the trainer's
    validity rule, see tessera.planner.trainable) drops the layouts it refuses; it is asked in rank order
    and only until ``top`` layouts are accepted. ``host_counts``: the device's memory is the host's (CPU
    ranks), so a layout must fit its device and host bytes together. Raises ConfigError when the batch
    divides no layout and NoLayoutFits when none fits in memory, or none that fits is one the rule
    accepts."""
    seq = seq or spec.seq
    check_request(spec, gpu, gpus, global_batch, seq)
    limit = gpu.memory_bytes * gpu.usable_fraction

    def resident(layout) -> float:
        mem, host = memory_per_rank(spec, layout, global_batch, seq, precision, optimizer)
        return mem["total"] + (host if host_counts else 0.0)

    sized = [(resident(layout), layout)
             for layout in enumerate_layouts(spec, gpus, global_batch, seq, gpu.gpus_per_node, space)]
    if not sized:
        raise ConfigError(
            f"the global batch of {global_batch} sequences cannot be split over any layout of {gpus} GPUs "
            f"for {spec.name}: choose a batch divisible by the data-parallel degree that is left after "
            f"tensor, pipeline and context parallelism")
    fitting = [estimate(spec, layout, gpu, global_batch, seq, precision, optimizer)
               for total, layout in sized if total <= limit]
    if not fitting:
        smallest = _smallest(sized, rule)
        need = resident(smallest) / GB
        raise NoLayoutFits(
            f"no layout fits: the smallest{' tessera train runs' if rule else ''} ({smallest.describe()}) "
            f"needs {need:.1f} GB per GPU and {gpu.name} has {limit / GB:.1f} GB usable")
    fitting.sort(key=lambda e: (e.step_time_s, e.memory_bytes["total"]))
    ranked, refused = _accepted(fitting, rule, top)
    if not ranked:
        layout, reason = refused[0]
        raise NoLayoutFits(f"none of the {len(fitting)} layouts that fit is one tessera train runs; the "
                           f"fastest ({layout.describe()}) is refused: {reason}")
    return Plan(ranked, len(sized), len(fitting), refused)


def _accepted(ranked: list, rule, top: int | None) -> tuple[list, list]:
    """The first ``top`` (all: None) estimates the rule accepts, and the (layout, reason) it refused."""
    if rule is None:
        return ranked[:top] if top else ranked, []
    accepted, refused = [], []
    for est in ranked:
        reason = rule(est.layout)
        if reason is None:
            accepted.append(est)
            if top and len(accepted) == top:
                break
        else:
            refused.append((est.layout, reason))
    return accepted, refused


def _smallest(sized: list, rule):
    """The least-memory layout of ``(bytes, layout)`` pairs that the rule accepts (any, without a rule)."""
    ordered = sorted(sized, key=lambda pair: pair[0])
    for _, layout in ordered:
        if rule is None or rule(layout) is None:
            return layout
    reason = rule(ordered[0][1])
    raise NoLayoutFits(f"none of the {len(sized)} layouts is one tessera train runs; the smallest "
                       f"({ordered[0][1].describe()}) is refused: {reason}")
