"""``tessera train --deepspeed ds_config.json``: a DeepSpeed config, as written, mapped onto tessera's keys.

Two steps, both before any rank starts:

1. :func:`read_deepspeed` (a file or the dict form) checks every key against
   :data:`tessera.train.deepspeed_keys.KEYS` and returns a :class:`DeepSpeedJob`: ``--section.key=value``
   overrides (the CLI puts them after ``--config`` and before the user's own overrides, which win), the
   notes for keys without effect, and DeepSpeed's three batch keys.
2. :meth:`DeepSpeedJob.settle`, once the layout is decided (after ``parallel.auto``, before validation),
   resolves DeepSpeed's batch rule with tessera's data-parallel degree and turns each mapped key that the
   resolved job would not use (:data:`tessera.train.settings.SCOPES`) back into its default and a note.

Where a DeepSpeed config is silent, DeepSpeed's defaults apply where they change results (no gradient
clipping; an optimizer section's own defaults; a constant lr without a scheduler; fp16's loss-scaler
defaults); everything else keeps tessera's. docs/DEEPSPEED.md is the table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tessera.errors import ConfigError
from tessera.train.deepspeed_keys import KEYS
from tessera.train.deepspeed_map import (COMM_DTYPES, map_optimizer, map_precision, map_scheduler, map_zero,
                                         read_bool, read_choice, read_int, read_num, read_section)

NOTE = "tessera: note: deepspeed key '{}' has no effect here: {}"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass
class DeepSpeedJob:
    overrides: list[str] = field(default_factory=list)  # "--section.key=value", DeepSpeed's order
    notes: list[str] = field(default_factory=list)  # one line each, printed once by the launching process
    batch: dict = field(default_factory=dict)  # the batch keys the config gives (BATCH_KEYS)
    origin: dict = field(default_factory=dict)  # tessera key -> the DeepSpeed key it came from

    def put(self, key: str, value, path: str) -> None:
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        self.overrides.append(f"--{key}={text}")
        self.origin[key] = path

    def note(self, path: str, why: str) -> None:
        self.notes.append(NOTE.format(path, why))

    def settle(self, cfg, world_size: int, user_keys=frozenset()) -> list[str]:
        """Finish the mapping on ``cfg`` (a JobConfig, changed in place) for ``world_size`` ranks; return the
        notes of the mapped keys this job does not use. ``user_keys``: "section.key" the user set himself."""
        par = cfg.parallel.resolved(world_size)
        self._settle_batch(cfg, par, user_keys)
        return self._drop_without_effect(cfg, par, user_keys)

    def _settle_batch(self, cfg, par, user_keys) -> None:
        train, micro, gas = (self.batch.get(k) for k in BATCH_KEYS)
        if train is None and micro is None:
            if gas is not None:  # DeepSpeed's own assertion
                raise ConfigError("deepspeed's gradient_accumulation_steps needs train_batch_size or "
                                  "train_micro_batch_size_per_gpu ('Either train_batch_size or "
                                  "train_micro_batch_size_per_gpu needs to be provided')")
            return  # the batch is tessera's [data] keys
        if cfg.parallel.auto:  # it planned with train_batch_size (data.global_batch_size) and chose the micro-batch
            if micro is not None or gas is not None:
                raise ConfigError("parallel.auto=true chooses the micro-batch, which deepspeed's "
                                  "train_micro_batch_size_per_gpu or gradient_accumulation_steps also fixes; "
                                  "remove one of them")
            return
        train, micro, gas = batch_sizes(train, micro, gas, par.dp_replicate * par.dp_shard)
        self._set(cfg, "data.global_batch_size", train, "train_batch_size", user_keys)
        self._set(cfg, "data.micro_batch_size", micro, "train_micro_batch_size_per_gpu", user_keys)
        if par.pp > 1:  # DeepSpeed's pipeline engine runs gradient_accumulation_steps micro-batches per step
            self._set(cfg, "pipeline.microbatches", gas, "gradient_accumulation_steps", user_keys)

    def _set(self, cfg, key: str, value, path: str, user_keys) -> None:
        if key in user_keys:
            return
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
        if value != getattr(type(getattr(cfg, section))(), name):
            cfg.explicit[key] = value
        self.origin[key] = path

    def _drop_without_effect(self, cfg, par, user_keys) -> list[str]:
        from tessera.train.auto_layout import AUTO_KEYS
        from tessera.train.settings import SCOPES

        notes = []
        for key, path in self.origin.items():  # in mapping order: zero.offload before zero.offload_dir
            if key in user_keys or key not in cfg.explicit:
                continue
            scope = next((s for s in SCOPES if s.covers(key) and not s.applies(cfg, par)), None)
            if scope is not None:
                section, name = key.split(".")
                if not (cfg.parallel.auto and key in AUTO_KEYS):  # else the value is parallel.auto's choice
                    setattr(getattr(cfg, section), name, getattr(type(getattr(cfg, section))(), name))
                del cfg.explicit[key]
                notes.append(NOTE.format(path, f"it applies only {scope.only}, but {scope.now(cfg, par)}"))
        return notes


def batch_sizes(train, micro, gas, dp: int) -> tuple[int, int, int]:
    """DeepSpeed's ``_set_batch_related_parameters`` then ``_batch_assertion`` (runtime/config.py), with
    tessera's data-parallel degree ``dp`` as DeepSpeed's world size: (train, micro, gas)."""
    if train is not None and micro is not None and gas is None:
        gas = train // micro // dp
    elif train is not None and gas is not None and micro is None:
        micro = train // dp // gas
    elif train is None:
        gas = 1 if gas is None else gas
        train = micro * gas * dp
    elif micro is None:
        gas, micro = 1, train // dp
    if micro <= 0 or gas <= 0 or train != micro * gas * dp:
        raise ConfigError(f"deepspeed's batch sizes disagree with {dp} data-parallel rank(s), as DeepSpeed's "
                          f"check says: 'train_batch_size is not equal to micro_batch_per_gpu * "
                          f"gradient_acc_step * world_size {train} != {micro} * {gas} * {dp}'")
    return train, micro, gas


def read_deepspeed(source) -> DeepSpeedJob:
    """A DeepSpeed config (a JSON file's path, or the dict form) as a :class:`DeepSpeedJob`."""
    ds = source if isinstance(source, dict) else _load(Path(source))
    job = DeepSpeedJob()
    _walk(ds, "", job)
    for key in BATCH_KEYS:
        if key in ds:
            job.batch[key] = read_int(ds, key, None, minimum=1)
    if "train_batch_size" in job.batch:  # known without the layout: parallel.auto plans with it
        job.put("data.global_batch_size", job.batch["train_batch_size"], "train_batch_size")
    if "train_micro_batch_size_per_gpu" in job.batch:
        job.put("data.micro_batch_size", job.batch["train_micro_batch_size_per_gpu"],
                "train_micro_batch_size_per_gpu")
    # DeepSpeed's default gradient_clipping is 0: no clipping (tessera's own default clips at 1.0)
    job.put("optim.grad_clip", read_num(ds, "gradient_clipping", 0.0, minimum=0), "gradient_clipping")
    job.put("train.log_every", read_int(ds, "steps_per_print", 10, minimum=1), "steps_per_print")
    job.put("train.time_breakdown", read_bool(ds, "wall_clock_breakdown", False), "wall_clock_breakdown")
    if "tensorboard" in ds:
        job.put("run.tensorboard", read_bool(read_section(ds, "tensorboard"), "enabled", False, "tensorboard."),
                "tensorboard.enabled")
    lr = map_optimizer(ds, job)
    map_scheduler(ds, job, lr)
    dtype = map_precision(ds, job)
    reduce_dtype = ""
    if "communication_data_type" in ds:
        reduce_dtype = read_choice(ds, "communication_data_type", None, COMM_DTYPES)
        job.put("precision.reduce_dtype", COMM_DTYPES[reduce_dtype], "communication_data_type")
    map_zero(ds, job, dtype, COMM_DTYPES.get(reduce_dtype, dtype))
    if "activation_checkpointing" in ds:  # see docs/DEEPSPEED.md: tessera's model checkpoints every block
        read_section(ds, "activation_checkpointing")
        job.put("checkpointing.mode", "full", "activation_checkpointing")
    return job


def _load(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"deepspeed config '{path}' does not exist")

    def no_duplicates(pairs):  # DeepSpeed refuses a key given twice (dict_raise_error_on_duplicate_keys)
        keys = [k for k, _ in pairs]
        twice = next((k for k in keys if keys.count(k) > 1), None)
        if twice is not None:
            raise ConfigError(f"deepspeed config '{path}' gives the key '{twice}' twice")
        return dict(pairs)

    try:
        ds = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=no_duplicates)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"deepspeed config '{path}' is not valid JSON: {err}") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"deepspeed config '{path}' must hold a JSON object, got {type(ds).__name__}")
    return ds


def _same(value, quiet: tuple) -> bool:
    return any(value == q and isinstance(value, bool) == isinstance(q, bool) for q in quiet)


def _walk(ds: dict, prefix: str, job: DeepSpeedJob) -> None:
    """Every key of ``ds`` against the table: unknown ones and refused values raise, notes are collected."""
    for name, value in ds.items():
        path = f"{prefix}{name}"
        row = KEYS.get(path)
        if row is None:
            raise ConfigError(f"deepspeed key '{path}' is not one tessera implements; remove it "
                              f"(docs/DEEPSPEED.md lists every key it reads)")
        if row.tree:  # a whole section: silent when switched off
            if value is False or (isinstance(value, dict) and value.get("enabled", True) is False):
                continue
        elif row.action == "map":
            if isinstance(value, dict):
                _walk(value, path + ".", job)
            continue
        elif _same(value, row.quiet):
            continue
        if row.action == "refuse":
            shown = "" if isinstance(value, dict) else f"={json.dumps(value)}"
            raise ConfigError(f"deepspeed key '{path}'{shown} cannot be honoured: {row.why}")
        job.note(path, row.why)
