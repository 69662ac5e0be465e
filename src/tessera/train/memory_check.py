"""The memory check before launch (``run.check_memory``): the planner's predicted peak memory of a rank
against the memory this machine gives each local rank. A job that would not fit is refused with one
sentence that names a layout of the same world size that fits, or, when none does, what would.

A rank's predicted peak is that of the busiest pipeline stage's rank: the planner's device bytes (model
states, activations, ZeRO-3's gathered units and gradients, buffers: ``tessera.planner.estimate.
stage_memory``, the prediction ``--dry-run`` prints) and, on the CPU, its host bytes too (offloaded
optimizer states live in the same RAM) and the fixed cost of a process
(``tessera.planner.machine.PROCESS_BYTES``). A LoRA job (``[lora]``) is counted as one: frozen base
weights in the training dtype, gradients and optimizer states for the adapters alone. The memory per
local rank is the RAM available now shared by the local ranks, or each rank's own accelerator
(``tessera.planner.machine``); 10% of it is kept free.
Under torchrun the ranks are already running and reading the available RAM would race between them, so
every rank judges against the machine's total RAM instead (the same for all, so they agree).

The layout named is found by the planner's search over the layouts of the same world size that this job
can run: each candidate is written into a copy of the job's configuration and judged by the trainer's
own validation, as if typed by hand, and the copy must run exactly the candidate. Disk offload is
proposed only when nothing fits without it.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

from tessera.errors import ConfigError
from tessera.planner import NoLayoutFits, from_model_config
from tessera.planner.estimate import stage_memory
from tessera.planner.local import local_gpu
from tessera.planner.machine import HEADROOM, PROCESS_BYTES, host_memory_bytes, usable_per_rank
from tessera.planner.search import RECOMPUTES, SearchSpace, search
from tessera.planner.trainable import layout_settings
from tessera.train.dry_run import planner_layout

GB = 1e9
MORE_MACHINES = (2, 4, 8, 16)  # machines like this one that the advice tries when no layout fits here
TRIED = 100  # fitting layouts, fastest first, that the trainer's rule is asked about


@dataclass
class Budget:
    """The memory this machine gives each of ``local_ranks`` ranks, and where the figure comes from."""

    per_rank: float
    local_ranks: int
    source: str  # e.g. "23.6 GB of RAM available / 2 local ranks"
    on_cpu: bool

    @property
    def usable(self) -> float:
        """What a rank's predicted peak may reach (the headroom kept free)."""
        return usable_per_rank(self.per_rank)

    @property
    def for_planner(self) -> float:
        """What the planner's bytes may reach: the usable memory less a CPU process's fixed cost."""
        return self.usable - (PROCESS_BYTES if self.on_cpu else 0.0)


def machine_budget(device_name: str, local_ranks: int, ranks_running: bool = False) -> Budget:
    """This machine's memory per local rank for ``run.device`` = ``device_name``. ``ranks_running``
    (under torchrun): judge against the total RAM, which every running rank reads alike."""
    from tessera.device import device_memory_bytes, resolve_device

    device = resolve_device(device_name)
    if device.type != "cpu":
        total = device_memory_bytes(device)
        return Budget(total, local_ranks, f"{total / GB:.1f} GB of {device.type} memory per device", False)
    ram = _total_ram() if ranks_running else host_memory_bytes()
    what = "total RAM" if ranks_running else "RAM available"
    return Budget(ram / local_ranks, local_ranks, f"{ram / GB:.1f} GB of {what} / {local_ranks} local ranks", True)


def _total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def predicted_peak(cfg, par, on_cpu: bool = True) -> float:
    """Predicted peak bytes of the busiest rank of ``cfg`` resolved to ``par`` (see the module docstring)."""
    layout, batch, _ = planner_layout(cfg, par)
    spec = job_spec(cfg)
    precision = _precision(cfg)
    peaks = []
    for stage in range(layout.pp):
        mem, host = stage_memory(spec, layout, batch, cfg.data.seq_len, precision, "adam", stage)
        peaks.append(mem["total"] + (host + PROCESS_BYTES if on_cpu else 0.0))
    return max(peaks)


def job_spec(cfg):
    """The planner's model of the job ``cfg``: its shapes, experts and LoRA adapters (``[lora]``)."""
    return from_model_config(cfg.model_preset, cfg.model, top_k=cfg.moe.top_k, lora=cfg.lora)


def _precision(cfg) -> str:
    return "fp32" if cfg.precision.dtype == "fp32" else "mixed"


def check_memory(cfg, par, world: int, budget: Budget) -> None:
    """Raise ConfigError (one sentence) when a rank's predicted peak exceeds ``budget``'s usable memory;
    nothing when it fits or ``run.check_memory`` is false."""
    if not cfg.run.check_memory:
        return
    verdict = memory_verdict(cfg, par, world, budget)
    if verdict is not None:
        raise ConfigError(verdict)


def memory_verdict(cfg, par, world: int, budget: Budget) -> str | None:
    """None when the job fits ``budget``, else the refusal's sentence (with its advice)."""
    need = predicted_peak(cfg, par, budget.on_cpu)
    if need <= budget.usable:
        return None
    return (f"a rank's predicted peak memory, {need / GB:.1f} GB ({planner_layout(cfg, par)[0].describe()}), "
            f"is more than the {budget.usable / GB:.1f} GB usable per local rank here ({budget.source}, "
            f"{HEADROOM:.0%} kept free); {advice(cfg, par, world, budget)}; run.check_memory=false skips this check")


def advice(cfg, par, world: int, budget: Budget) -> str:
    """What to run instead: a layout of ``world`` ranks that fits, else as many ranks again on more
    machines like this one, else fewer ranks here or something smaller."""
    if budget.for_planner <= 0:  # not even an empty process fits
        most = int(budget.usable * budget.local_ranks // PROCESS_BYTES)
        return (f"a rank costs {PROCESS_BYTES / GB:.2f} GB before it holds any model state, so this machine "
                f"has room for at most {most} local ranks: run fewer, or spread the job over machines")
    found = fitting_layout(cfg, world, budget)
    if found is not None:
        layout, need = found
        flags = " ".join(changed_flags(cfg, par, layout))
        return f"a layout of {world} ranks that fits is {flags} ({layout.describe()}, {need / GB:.1f} GB per rank)"
    for machines in MORE_MACHINES:
        found = fitting_layout(cfg, world * machines, budget)
        if found is not None:
            layout, need = found
            flags = " ".join(changed_flags(cfg, par, layout))
            return (f"no layout of {world} ranks fits, but {world * machines} ranks on {machines} machines like "
                    f"this one would: {flags} ({layout.describe()}, {need / GB:.1f} GB per rank)")
    return (f"no layout fits on {world} ranks, nor on up to {MORE_MACHINES[-1]} machines like this one; a "
            f"smaller model, data.seq_len or data.micro_batch_size would")


def fitting_layout(cfg, world: int, budget: Budget):
    """(layout, predicted peak bytes) of the fastest layout of ``world`` ranks that this job can run and
    that fits ``budget`` (disk offload only when nothing fits without it), or None. The trainer's rule
    is asked of the :data:`TRIED` fastest fitting layouts only (each is a validation of a whole config)."""
    spec = job_spec(cfg)
    gpu = local_gpu(world, memory_bytes=budget.for_planner)
    rule = job_rule(cfg, world)
    # host offload frees an accelerator's memory, not the RAM of CPU ranks
    kinds = (() if budget.on_cpu else (True,)) + ("disk",)
    for offload_to in [(), *((kind,) for kind in kinds)]:
        space = SearchSpace(recompute=RECOMPUTES, offload=bool(offload_to), offload_to=offload_to or (True,))
        try:
            ranked = search(spec, gpu, world, cfg.data.global_batch_size, cfg.data.seq_len,
                            precision=_precision(cfg), space=space, host_counts=budget.on_cpu).ranked
        except (NoLayoutFits, ConfigError):
            continue
        for est in ranked[:TRIED]:
            if rule(est.layout) is None:
                trial = with_layout(cfg, est.layout)
                return est.layout, predicted_peak(trial, trial.parallel.resolved(world), budget.on_cpu)
    return None


def with_layout(cfg, layout):
    """A copy of the JobConfig ``cfg`` that runs ``layout`` (its every layout key written, as if typed)."""
    trial = copy.deepcopy(cfg)
    trial.parallel.auto = False
    for key, value in layout_settings(layout, cfg.data.global_batch_size).items():
        section, name = key.split(".")
        setattr(getattr(trial, section), name, value)
    return trial


def job_rule(cfg, world: int):
    """``rule(layout) -> reason | None``: None when ``cfg`` with ``layout`` written into it is a job the
    trainer runs on ``world`` ranks, and that job runs exactly ``layout``."""
    from tessera.train.config import validate_config

    def rule(layout) -> str | None:
        trial = with_layout(cfg, layout)
        try:
            validate_config(trial, world)
        except ConfigError as err:
            return str(err)
        if planner_layout(trial, trial.parallel.resolved(world))[0] != layout:
            return "the job would not run this layout exactly"
        return None

    return rule


def changed_flags(cfg, par, layout) -> list[str]:
    """``--section.key=value`` for each layout key whose value differs from the job's (resolved)."""
    flags = []
    for key, value in layout_settings(layout, cfg.data.global_batch_size).items():
        section, name = key.split(".")
        have = getattr(par if section == "parallel" else getattr(cfg, section), name)
        if have != value:
            flags.append(f"--{key}={str(value).lower() if isinstance(value, bool) else value}")
    return flags


def memory_report(cfg, par, world: int, budget: Budget) -> str:
    """The dry run's line: the predicted peak against the memory per local rank, and the verdict."""
    if not cfg.run.check_memory:
        return "memory check: off (run.check_memory=false)"
    need = predicted_peak(cfg, par, budget.on_cpu)
    fixed = f", {PROCESS_BYTES / GB:.2f} GB of it a process's fixed cost" if budget.on_cpu else ""
    head = (f"memory check: a rank's predicted peak {need / GB:.2f} GB{fixed}; usable per local rank "
            f"{budget.usable / GB:.2f} GB ({budget.source}, {HEADROOM:.0%} kept free)")
    if need <= budget.usable:
        return f"{head}: fits"
    return f"{head}: a launch here would be refused; {advice(cfg, par, world, budget)}"
