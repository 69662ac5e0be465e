"""``--parallel.auto=true``: the planner picks the local layout before any rank starts.

The planner ranks every layout of the world size by predicted step time (with this machine's
orientation values; `tessera plan --calibrate` measures real ones) and keeps only those the trainer
runs: a candidate is written into a copy of the config and judged by the trainer's own validation
(:func:`tessera.train.config.validate_config`), as if the user had typed it. The fastest one is written
into the config. parallel.auto chooses only :data:`AUTO_KEYS`; a layout that would need another key
(a pipeline's micro-batch count, its chunks per rank) to differ from the job's is not the layout the job
would run, so it is skipped.
"""

from __future__ import annotations

import copy

from tessera.errors import ConfigError
from tessera.planner import NoLayoutFits
from tessera.planner.local import as_degrees, rank_local_layouts
from tessera.planner.trainable import layout_settings

# every key parallel.auto writes over; tessera.train.settings refuses a user's own value for any of them
AUTO_KEYS = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.pp", "parallel.tp", "parallel.cp",
             "parallel.ep", "parallel.zero_stage", "tensor_parallel.sequence_parallel", "pipeline.schedule",
             "data.micro_batch_size")
STRATEGIES = ("dp", "zero", "tp", "sp", "pp", "cp")  # the search space; ep is searched for MoE models


def apply_auto_layout(cfg, world_size: int) -> dict:
    """Fill ``cfg.parallel`` (and sequence parallelism, schedule, micro-batch) from the planner; returns
    the chosen degrees with the predicted step time. ``cfg`` is a JobConfig, changed in place."""
    best = ranked_layouts(cfg, world_size, top=1)[0]
    degrees = as_degrees(best.layout, best.step_time_s)
    _write(cfg, degrees)
    return degrees


def ranked_layouts(cfg, world_size: int, top: int | None = None) -> list:
    """The planner's Estimates of the layouts of ``world_size`` ranks that this job (a JobConfig) can
    run, fastest first (the first ``top``); ConfigError when there is none."""
    precision = "fp32" if cfg.precision.dtype == "fp32" else "mixed"
    try:
        return rank_local_layouts(cfg.model, world_size, cfg.data.global_batch_size, cfg.data.seq_len,
                                  precision=precision, strategies=STRATEGIES, rule=trainer_rule(cfg, world_size),
                                  top=top)
    except NoLayoutFits as err:
        raise ConfigError(f"parallel.auto found no layout for {world_size} ranks: {err}; set the parallel "
                          f"degrees by hand") from None


def trainer_rule(cfg, world_size: int):
    """``rule(layout) -> reason | None``: None when writing ``layout`` into ``cfg`` gives a job the trainer
    runs on ``world_size`` ranks, and that job runs exactly ``layout``."""
    from tessera.train.config import validate_config

    def rule(layout) -> str | None:
        degrees = as_degrees(layout)
        chosen = chosen_settings(degrees)
        for key, value in layout_settings(layout, cfg.data.global_batch_size).items():
            section, name = key.split(".")
            have = getattr(getattr(cfg, section), name)
            if key not in chosen and have != value:
                return f"it needs {key}={value!r}, which parallel.auto does not choose (this job has {have!r})"
        trial = copy.deepcopy(cfg)
        trial.parallel.auto = False  # judged as if the user had typed the layout
        _write(trial, degrees)
        try:
            validate_config(trial, world_size)
        except ConfigError as err:
            return str(err)
        return None

    return rule


def _write(cfg, degrees: dict) -> None:
    chosen = chosen_settings(degrees)
    for key in AUTO_KEYS:
        if key in chosen:
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, chosen[key])


def chosen_settings(degrees: dict) -> dict:
    """The planner's ``degrees`` as ``"section.key" -> value``, keys of :data:`AUTO_KEYS` (the schedule
    only for a pipeline, the micro-batch only when the planner chose one)."""
    chosen = {f"parallel.{k}": int(degrees[k]) for k in ("dp_replicate", "dp_shard", "pp", "tp", "cp", "ep",
                                                           "zero_stage")}
    chosen["tensor_parallel.sequence_parallel"] = bool(degrees["sequence_parallel"]) and chosen["parallel.tp"] > 1
    if chosen["parallel.pp"] > 1 and degrees.get("schedule"):
        chosen["pipeline.schedule"] = degrees["schedule"]
    if degrees.get("micro_batch_size"):
        chosen["data.micro_batch_size"] = int(degrees["micro_batch_size"])
    return chosen
