"""Every setting a user writes changes what happens, or is refused with one sentence before any rank starts.

Two rules, checked by :func:`tessera.train.config.validate_config`:

- **Finite numbers.** No number anywhere in the configuration may be nan or ±inf (no key gives them a
  meaning): ``--optim.lr=nan`` would otherwise train on nothing, or deep inside a rank fail.
- **No setting without effect.** A key the user set explicitly (in the TOML file or as an override) to
  a value other than its default, which the resolved layout does not use, is refused: a ``[pipeline]``
  key with ``parallel.pp = 1``, ``[tensor_parallel]`` with ``tp = 1``, ``[moe]`` for a dense model,
  ``[ps]`` outside the parameter-server mode, a key ``parallel.auto`` chooses itself, …  Each such case
  is one :class:`Scope` row of :data:`SCOPES` (which keys, when they act): one table, one check.
  Defaults are never refused, so the resolved ``config.toml`` a run writes (every key, resolved) is
  accepted back by ``--config``.

Not here: keys whose effect is settled at run time by the strategy that reads them
(``precision.loss_scale``, which every path divides out again), and the launch keys of ``[run]``,
which ``torchrun`` documents as its own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from tessera.errors import ConfigError
from tessera.parallelize import engine_holds_optimizer
from tessera.train.auto_layout import AUTO_KEYS

# string keys whose text may be a number (checked for finiteness like the float keys)
NUMBER_TEXT = ("precision.loss_scale",)
# what the parameter-server mode (model.preset = "ctr") reads besides [ps]; every other key is unused
CTR_READS = ("run.name", "run.out_dir", "run.seed", "run.progress", "train.steps", "train.log_every")
ZERO3_KEYS = ("zero.reshard_after_forward", "zero.prefetch", "zero.wrap_policy", "zero.wrap_paths", "zero.wrap_classes",
              "zero.prefetch_params", "zero.max_live_params")


# ---- finite numbers -----------------------------------------------------------------------------


def _finite(value, key: str) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v, key) for v in value)
    if isinstance(value, str) and key in NUMBER_TEXT:
        try:
            return math.isfinite(float(value))
        except ValueError:
            return True  # a word ("auto", "dynamic"): the section's own check judges it
    return True


def check_finite(cfg, sections) -> None:
    """Raise ConfigError naming the first key of ``sections`` (names of JobConfig fields) holding nan/inf."""
    for name in sections:
        section = getattr(cfg, name)
        for f in dataclasses.fields(section):
            value, key = getattr(section, f.name), f"{name}.{f.name}"
            if not _finite(value, key):
                raise ConfigError(f"{key}={value!r} is not a finite number; every number in the "
                                  f"configuration must be finite")


# ---- settings that take effect ------------------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """Keys that act only when ``applies(cfg, par)`` holds (``par``: the resolved ParallelConfig).
    ``only`` says when they act, ``now(cfg, par)`` why they do not in this job."""

    covers: Callable[[str], bool]
    applies: Callable
    only: str
    now: Callable


def _keys(*names: str) -> Callable[[str], bool]:
    """Matches each of ``names``: a whole section (``"pipeline"``) or one key (``"pipeline.layers"``)."""
    return lambda key: key in names or key.split(".", 1)[0] in names


def _all_but(*names: str) -> Callable[[str], bool]:
    inside = _keys(*names)
    return lambda key: key != "model.preset" and not inside(key)


def _engine(cfg, par) -> bool:
    """A ZeRO / fp32-master engine holds the optimizer (the rule of tessera.parallelize; ddp.mode="ps-sharded"
    is ZeRO-1's engine with the exchange at the step)."""
    return engine_holds_optimizer(par, cfg.precision) or cfg.ddp.mode == "ps-sharded"


def _ddp(cfg, par) -> bool:
    """DistributedDataParallel reduces the gradients (a pipeline's data parallelism and expert parallelism's
    two reducers, dense over dp and experts over edp, read [ddp] too)."""
    return cfg.ddp.mode == "allreduce" and not _engine(cfg, par) and par.dp_replicate * par.dp_shard * par.cp > 1


def _no_ddp(cfg, par) -> str:
    if cfg.ddp.mode != "allreduce":
        return f"ddp.mode={cfg.ddp.mode!r} exchanges at the step, without DDP's buckets"
    if _engine(cfg, par):
        return (f"a ZeRO engine reduces the gradients here (parallel.zero_stage={par.zero_stage}, "
                f"precision.dtype={cfg.precision.dtype})")
    return "this layout has a single data-parallel rank"


def _dynamic(cfg, par) -> bool:
    scale = cfg.precision.loss_scale
    return scale == "dynamic" or (scale == "auto" and cfg.precision.dtype == "fp16")


# the fp16 dynamic loss scaler's keys: one scope, read only when the scale is dynamic
DYNAMIC_SCALE_KEYS = ("precision.init_scale", "precision.growth_interval", "precision.hysteresis",
                      "precision.min_loss_scale", "precision.consecutive_hysteresis", "precision.growth_delay")
# the learning-rate decay's keys, unused by the schedules that hold the rate after their warm-up
DECAY_KEYS = ("optim.min_lr_ratio", "optim.total_steps")
NON_DECAYING = ("constant", "deepspeed-warmup")


SCOPES: tuple[Scope, ...] = (
    Scope(_keys(*AUTO_KEYS), lambda c, p: not c.parallel.auto, "when the layout is chosen by hand",
          lambda c, p: "parallel.auto=true chooses it"),
    Scope(_keys("ps"), lambda c, p: c.model_preset == "ctr", "in the parameter-server mode (model.preset=ctr)",
          lambda c, p: f"model.preset={c.model_preset!r}"),
    Scope(_all_but("ps", *CTR_READS), lambda c, p: c.model_preset != "ctr", "to the collective trainer",
          lambda c, p: "model.preset='ctr' runs the parameter-server job, which reads only [ps], "
                       "train.steps, train.log_every and run.name, out_dir, seed and progress"),
    Scope(_keys("pipeline"), lambda c, p: p.pp > 1, "with pipeline parallelism (parallel.pp > 1)",
          lambda c, p: f"parallel.pp={p.pp}"),
    Scope(_keys("pipeline.layers"), lambda c, p: c.pipeline.partition == "explicit",
          "with pipeline.partition='explicit'", lambda c, p: f"pipeline.partition={c.pipeline.partition!r}"),
    Scope(_keys("pipeline.layer_costs"), lambda c, p: c.pipeline.partition == "cost",
          "with pipeline.partition='cost'", lambda c, p: f"pipeline.partition={c.pipeline.partition!r}"),
    Scope(_keys("pipeline.microbatches"), lambda c, p: c.pipeline.schedule != "naive",
          "to schedules that split the batch", lambda c, p: "pipeline.schedule='naive' runs it whole"),
    Scope(_keys("pipeline.flush"), lambda c, p: c.pipeline.schedule in ("pipedream", "2bw"),
          "to the weight-stashing schedules pipedream and 2bw (the others drain to update every stage at once)",
          lambda c, p: f"pipeline.schedule={c.pipeline.schedule!r}"),
    Scope(_keys("tensor_parallel"), lambda c, p: p.tp > 1, "with tensor parallelism (parallel.tp > 1)",
          lambda c, p: f"parallel.tp={p.tp}"),
    Scope(_keys("tensor_parallel.depth"), lambda c, p: c.tensor_parallel.mode == "2.5d",
          "to tensor_parallel.mode='2.5d'", lambda c, p: f"tensor_parallel.mode={c.tensor_parallel.mode!r}"),
    Scope(_keys("context_parallel"), lambda c, p: p.cp > 1, "with context parallelism (parallel.cp > 1)",
          lambda c, p: f"parallel.cp={p.cp}"),
    Scope(_keys("moe", "model.moe_every"), lambda c, p: c.model.num_experts > 0,
          "to a mixture-of-experts model (model.num_experts > 0)", lambda c, p: "model.num_experts=0"),
    Scope(_keys("moe.jitter_eps"), lambda c, p: c.moe.noisy_gate_policy == "jitter",
          "with moe.noisy_gate_policy='jitter'", lambda c, p: f"moe.noisy_gate_policy={c.moe.noisy_gate_policy!r}"),
    Scope(_keys("zero"), _engine, "when a ZeRO engine holds the optimizer (parallel.zero_stage >= 1, or "
          "mixed precision outside a pipeline)", lambda c, p: "parallel.zero_stage=0 in fp32"),
    Scope(_keys(*ZERO3_KEYS), lambda c, p: p.zero_stage == 3, "to ZeRO-3 (parallel.zero_stage=3)",
          lambda c, p: f"parallel.zero_stage={p.zero_stage}"),
    Scope(_keys("zero.min_params"), lambda c, p: p.zero_stage == 3 and c.zero.wrap_policy == "size",
          "to ZeRO-3 with zero.wrap_policy='size'",
          lambda c, p: f"parallel.zero_stage={p.zero_stage}, zero.wrap_policy={c.zero.wrap_policy!r}"),
    Scope(_keys("zero.wrap_paths", "zero.wrap_classes"), lambda c, p: c.zero.wrap_policy == "manual",
          "with zero.wrap_policy='manual'", lambda c, p: f"zero.wrap_policy={c.zero.wrap_policy!r}"),
    Scope(_keys("zero.allgather_bucket_mb"), lambda c, p: p.zero_stage in (1, 2),
          "to ZeRO-1/2 (parallel.zero_stage=1 or 2)", lambda c, p: f"parallel.zero_stage={p.zero_stage}"),
    Scope(_keys("zero.offload_dir", "zero.offload_chunk_mb"), lambda c, p: c.zero.offload == "disk",
          "with disk offload (zero.offload='disk')", lambda c, p: f"zero.offload={str(c.zero.offload)!r}"),
    Scope(_keys("ddp.bucket_mb", "ddp.find_unused_parameters"), _ddp, "when DDP reduces the gradients", _no_ddp),
    Scope(_keys(*DYNAMIC_SCALE_KEYS), _dynamic,
          "with dynamic loss scaling (precision.loss_scale='dynamic', or 'auto' with fp16)",
          lambda c, p: f"precision.loss_scale={c.precision.loss_scale!r} with precision.dtype={c.precision.dtype!r}"),
    Scope(_keys("checkpointing.every"), lambda c, p: c.checkpointing.mode != "none",
          "with activation checkpointing (checkpointing.mode full or selective)",
          lambda c, p: "checkpointing.mode='none'"),
    Scope(_keys("kernels.compile_backend"), lambda c, p: c.kernels.compile, "with kernels.compile=true",
          lambda c, p: "kernels.compile=false"),
    Scope(_keys("kernels.gqa"), lambda c, p: c.model.n_kv_heads < c.model.n_heads,
          "to grouped-query attention (model.n_kv_heads < model.n_heads)",
          lambda c, p: f"model.n_kv_heads={c.model.n_kv_heads} equals model.n_heads={c.model.n_heads}"),
    Scope(_keys("data.bucket_multiple"), lambda c, p: c.data.bucketing == "length",
          "with length bucketing (data.bucketing=length)", lambda c, p: "data.bucketing='none'"),
    Scope(_keys("ddp.average_every"), lambda c, p: c.ddp.mode == "local-sgd", "to ddp.mode='local-sgd'",
          lambda c, p: f"ddp.mode={c.ddp.mode!r}"),
    Scope(_keys("ddp.devices"), lambda c, p: c.ddp.mode in ("dataparallel", "central-storage"),
          "to ddp.mode='dataparallel' or 'central-storage'", lambda c, p: f"ddp.mode={c.ddp.mode!r}"),
    Scope(_keys("ddp.consistency", "ddp.staleness"), lambda c, p: c.ddp.mode in ("ps-rank0", "ps-sharded"),
          "to the parameter-server modes (ddp.mode='ps-rank0' or 'ps-sharded')", lambda c, p: f"ddp.mode={c.ddp.mode!r}"),
    Scope(_keys("ddp.staleness"), lambda c, p: c.ddp.consistency == "ssp", "to ddp.consistency='ssp'",
          lambda c, p: f"ddp.consistency={c.ddp.consistency!r}"),
    Scope(_keys("optim.momentum", "optim.nesterov"), lambda c, p: c.optim.name == "sgd", "to optim.name='sgd'",
          lambda c, p: f"optim.name={c.optim.name!r}"),
    Scope(_keys("optim.beta1", "optim.beta2"), lambda c, p: c.optim.name in ("adamw", "adam"),
          "to optim.name='adamw' or 'adam'", lambda c, p: f"optim.name={c.optim.name!r}"),
    Scope(_keys("optim.eps"), lambda c, p: c.optim.name != "sgd", "to adamw, adam and adagrad",
          lambda c, p: "optim.name='sgd'"),
    Scope(_keys("optim.decay_fraction"), lambda c, p: c.optim.schedule == "wsd", "to optim.schedule='wsd'",
          lambda c, p: f"optim.schedule={c.optim.schedule!r}"),
    Scope(_keys(*DECAY_KEYS), lambda c, p: c.optim.schedule not in NON_DECAYING,
          "to the decaying schedules (cosine, linear, wsd, deepspeed-warmup-decay, deepspeed-warmup-cosine)",
          lambda c, p: f"optim.schedule={c.optim.schedule!r} never decays"),
    Scope(_keys("optim.warmup_type", "optim.warmup_min_ratio"), lambda c, p: c.optim.warmup_steps > 0,
          "with a warm-up (optim.warmup_steps > 0)", lambda c, p: "optim.warmup_steps=0"),
    Scope(_keys("precision.consecutive_hysteresis"), lambda c, p: c.precision.hysteresis > 1,
          "with precision.hysteresis > 1", lambda c, p: "precision.hysteresis=1 halves at every overflow"),
)


def check_settings_take_effect(cfg, parallel) -> None:
    """Raise ConfigError for the first key in ``cfg.explicit`` (the user's keys that differ from their
    defaults) that the job resolved to ``parallel`` (a resolved ParallelConfig) would not use."""
    for key, value in cfg.explicit.items():
        for scope in SCOPES:
            if scope.covers(key) and not scope.applies(cfg, parallel):
                raise ConfigError(f"{key}={value!r} has no effect in this job: it applies only {scope.only}, "
                                  f"but {scope.now(cfg, parallel)}; remove it or change that")
