"""``--parallel.auto=true``: the planner picks the local layout before any rank starts.

The planner ranks every layout of the world size by predicted step time (with this machine's
orientation values; `tessera plan --calibrate` measures real ones); the fastest one the trainer can
compose is written into the config, which is then validated as if the user had typed it.
"""

from __future__ import annotations

import copy

from tessera.errors import ConfigError
from tessera.planner import choose_local_layout

# every key parallel.auto writes over; tessera.train.settings refuses a user's own value for any of them
AUTO_KEYS = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.pp", "parallel.tp", "parallel.cp",
             "parallel.ep", "parallel.zero_stage", "tensor_parallel.sequence_parallel", "pipeline.schedule",
             "data.micro_batch_size")


def apply_auto_layout(cfg, world_size: int) -> dict:
    """Fill ``cfg.parallel`` (and sequence parallelism, schedule, micro-batch) from the planner; returns
    the chosen degrees with the predicted step time. ``cfg`` is a JobConfig, changed in place."""
    from tessera.composition import validate_composition

    def composable(degrees: dict) -> bool:
        trial = copy.deepcopy(cfg)
        _write(trial, degrees)
        try:
            validate_composition(trial, trial.parallel)  # _write gave it concrete degrees
        except ConfigError:
            return False
        return True

    precision = "fp32" if cfg.precision.dtype == "fp32" else "mixed"
    degrees = choose_local_layout(cfg.model, world_size, cfg.data.global_batch_size, cfg.data.seq_len,
                                  precision=precision, strategies=("dp", "zero", "tp", "sp", "pp", "cp"),
                                  accept=composable)
    _write(cfg, degrees)
    return degrees


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
