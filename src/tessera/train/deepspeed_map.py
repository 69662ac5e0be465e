"""The sections of a DeepSpeed config that need more than a renaming: optimizer, scheduler, fp16 / bf16 and
zero_optimization, each mapped onto tessera's keys by one function that adds overrides to a
:class:`tessera.train.deepspeed_json.DeepSpeedJob` (``job.put(tessera_key, value, deepspeed_key)``).

The semantics copied are DeepSpeed's (runtime/engine.py ``_configure_basic_optimizer``, lr_schedules.py,
precision_config.py, zero/config.py); a value DeepSpeed would reject, or one tessera cannot reproduce, is
refused with one sentence naming the key.
"""

from __future__ import annotations

import json

from tessera.errors import ConfigError

# DeepSpeed's optimizer names: lower-cased when they are DeepSpeed's own (adam, adamw, adagrad, ...); any other
# name is looked up in torch.optim as written ("SGD")
DEEPSPEED_OWN = ("adam", "adamw", "adagrad")
OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "adagrad": "adagrad", "SGD": "sgd"}
OPTIMIZER_PARAMS = {  # which params each optimizer's constructor takes (torch's and DeepSpeed's)
    "adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "fp32_optimizer_states",
             "bias_correction", "amsgrad", "foreach", "fused"),
    "sgd": ("lr", "momentum", "nesterov", "weight_decay", "dampening", "foreach", "fused"),
    "adagrad": ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value", "foreach"),
}
OPTIMIZER_DEFAULTS = {"adam": {"lr": 1e-3, "eps": 1e-8}, "sgd": {"lr": 1e-3}, "adagrad": {"lr": 1e-2, "eps": 1e-10}}
# tessera's schedules that are DeepSpeed's, iteration for iteration as its engine applies them (schedules.py)
SCHEDULES = {"WarmupLR": "deepspeed-warmup", "WarmupDecayLR": "deepspeed-warmup-decay",
             "WarmupCosineLR": "deepspeed-warmup-cosine"}
SCHEDULE_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
}
COMM_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16"}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
MB = 2**20  # tessera's bucket sizes are in MiB (build_buckets takes bucket_mb * 2**20 bytes)


def map_optimizer(ds: dict, job) -> float | None:
    """``optimizer`` → optim.name, lr, beta1, beta2, eps, weight_decay (momentum, nesterov); returns its lr
    (None when the config has no optimizer: the client's, tessera's [optim], is used)."""
    opt = read_section(ds, "optimizer")
    if not opt:
        return None
    typ = opt.get("type")
    if not isinstance(typ, str):
        raise _bad("optimizer.type", "an optimizer's name", typ)
    kind = OPTIMIZERS.get(typ.lower() if typ.lower() in DEEPSPEED_OWN else typ)
    if kind is None:
        raise ConfigError(f"deepspeed optimizer type '{typ}' is not one tessera offers: Adam, AdamW, Adagrad "
                          f"or SGD")
    params = read_section(opt, "params", "optimizer.")
    family = "adam" if kind in ("adam", "adamw") else kind
    wrong = next((k for k in params if k not in OPTIMIZER_PARAMS[family]), None)
    if wrong is not None:
        raise ConfigError(f"deepspeed key 'optimizer.params.{wrong}' does not apply to optimizer type '{typ}'")
    p, defaults = "optimizer.params.", OPTIMIZER_DEFAULTS[family]
    lr = read_num(params, "lr", defaults["lr"], p)
    if family == "adam":  # Adam with adam_w_mode (DeepSpeed's default: true) is AdamW; false is L2 Adam
        w_mode = read_bool(params, "adam_w_mode", True, p)
        kind = "adamw" if kind == "adamw" or w_mode else "adam"
        betas = params.get("betas", [0.9, 0.999])
        if not (isinstance(betas, list) and len(betas) == 2):
            raise _bad("optimizer.params.betas", "a list of two numbers", betas)
        job.put("optim.beta1", read_num({"b": betas[0]}, "b", None, "optimizer.params.betas "), p + "betas")
        job.put("optim.beta2", read_num({"b": betas[1]}, "b", None, "optimizer.params.betas "), p + "betas")
    if family == "sgd":
        job.put("optim.momentum", read_num(params, "momentum", 0.0, p), p + "momentum")
        job.put("optim.nesterov", read_bool(params, "nesterov", False, p), p + "nesterov")
    else:
        job.put("optim.eps", read_num(params, "eps", defaults["eps"], p), p + "eps")
    job.put("optim.name", kind, "optimizer.type")
    job.put("optim.lr", lr, p + "lr")
    job.put("optim.weight_decay", read_num(params, "weight_decay", 0.0, p), p + "weight_decay")
    return lr


def map_scheduler(ds: dict, job, lr: float | None) -> None:
    """``scheduler`` → optim.schedule, warmup_steps, warmup_type, warmup_min_ratio, min_lr_ratio, total_steps
    (and optim.lr: warmup_max_lr). No scheduler with an optimizer: DeepSpeed keeps the lr constant."""
    sch = read_section(ds, "scheduler")
    if not sch:
        if "optimizer" in ds:
            job.put("optim.schedule", "constant", "optimizer")
            job.put("optim.warmup_steps", 0, "optimizer")
        return
    typ = read_choice(sch, "type", None, tuple(SCHEDULES), "scheduler.")
    params, p = read_section(sch, "params", "scheduler."), "scheduler.params."
    wrong = next((k for k in params if k not in SCHEDULE_PARAMS[typ]), None)
    if wrong is not None:
        raise ConfigError(f"deepspeed key '{p}{wrong}' does not apply to scheduler type '{typ}'")
    if typ != "WarmupLR" and "total_num_steps" not in params:
        raise ConfigError(f"deepspeed's {typ} needs '{p}total_num_steps'")
    warmup = read_int(params, "warmup_num_steps", 1000, p, minimum=1)
    job.put("optim.schedule", SCHEDULES[typ], "scheduler.type")
    job.put("optim.warmup_steps", max(2, warmup), p + "warmup_num_steps")  # DeepSpeed's own floor of 2
    job.put("optim.warmup_type", read_choice(params, "warmup_type", "log", ("log", "linear"), p), p + "warmup_type")
    if typ != "WarmupLR":
        job.put("optim.total_steps", read_int(params, "total_num_steps", None, p, minimum=1), p + "total_num_steps")
    if typ == "WarmupCosineLR":  # the lr is the optimizer's; the ratios are the schedule's
        job.put("optim.warmup_min_ratio", read_num(params, "warmup_min_ratio", 0.0, p), p + "warmup_min_ratio")
        job.put("optim.min_lr_ratio", read_num(params, "cos_min_ratio", 1e-4, p), p + "cos_min_ratio")
        return
    # WarmupLR's warmup_max_lr defaults to the optimizer's lr, WarmupDecayLR's to 0.001 (lr_schedules.py)
    peak = read_num(params, "warmup_max_lr", lr if typ == "WarmupLR" else 1e-3, p)
    low = read_num(params, "warmup_min_lr", 0.0, p, minimum=0)
    if peak is None and low:
        raise ConfigError(f"deepspeed's WarmupLR needs '{p}warmup_max_lr' or optimizer.params.lr to express "
                          f"warmup_min_lr as a ratio of the lr")
    if peak is not None:
        job.put("optim.lr", peak, p + "warmup_max_lr")
        job.put("optim.warmup_min_ratio", low / peak if peak > 0 else 0.0, p + "warmup_min_lr")
    if typ == "WarmupDecayLR":  # linear from the peak back to warmup_min_lr at total_num_steps
        job.put("optim.min_lr_ratio", low / peak if peak > 0 else 0.0, p + "warmup_min_lr")


def map_precision(ds: dict, job) -> str:
    """``fp16`` / ``bf16`` → precision.dtype and fp16's loss scaling; returns the compute dtype.

    DeepSpeed's dynamic scaler, step for step: ``loss_scale_window`` W grows the scale after W + 1 clean
    steps the first time after the start or an overflow, W thereafter (precision.growth_delay = 1). Its
    hysteresis acts only under ZeRO (stages 1-3: DynamicLossScaler); without ZeRO its FP16 optimizers halve
    at every overflow (fused_optimizer.py / unfused_optimizer.py ``_update_scale``), so hysteresis is 1."""
    fp16 = read_section(ds, "fp16")
    bf16 = read_section(ds, "bf16") if "bf16" in ds else read_section(ds, "bfloat16")
    bf16_path = "bf16" if "bf16" in ds else "bfloat16"
    fp16_on = read_bool(fp16, "enabled", False, "fp16.")
    bf16_on = read_bool(bf16, "enabled", False, bf16_path + ".")
    if fp16_on and bf16_on:
        raise ConfigError("deepspeed's fp16 and bf16 are both enabled, which DeepSpeed refuses ('bfloat16 and "
                          "fp16 modes cannot be simultaneously enabled')")
    if bf16_on:
        job.put("precision.dtype", "bf16", bf16_path + ".enabled")
        return "bf16"
    if not fp16_on:
        if set(fp16) - {"enabled"}:
            job.note("fp16", "fp16.enabled is false")
        return "fp32"
    p = "fp16."
    job.put("precision.dtype", "fp16", p + "enabled")
    scale = read_num(fp16, "loss_scale", 0.0, p, minimum=0)
    dynamic = ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale")
    if scale > 0:  # a static scale: DeepSpeed ignores the dynamic scaler's keys
        job.put("precision.loss_scale", scale, p + "loss_scale")
        for key in (k for k in dynamic if k in fp16):
            job.note(p + key, f"it applies only to dynamic loss scaling, but fp16.loss_scale={scale:g} is static")
        return "fp16"
    # dynamic (loss_scale 0): DeepSpeed's defaults where the config is silent (precision_config.py)
    job.put("precision.init_scale", 2.0 ** read_int(fp16, "initial_scale_power", 16, p), p + "initial_scale_power")
    job.put("precision.growth_interval", read_int(fp16, "loss_scale_window", 1000, p, minimum=1),
            p + "loss_scale_window")
    job.put("precision.growth_delay", 1, p + "loss_scale_window")
    hysteresis = read_int(fp16, "hysteresis", 2, p, minimum=1)
    consecutive = read_bool(fp16, "consecutive_hysteresis", False, p)
    if zero_stage(ds) > 0:
        job.put("precision.hysteresis", hysteresis, p + "hysteresis")
        job.put("precision.consecutive_hysteresis", consecutive, p + "consecutive_hysteresis")
    else:
        written = {"hysteresis": fp16.get("hysteresis", 1) != 1, "consecutive_hysteresis": consecutive}
        for key in (k for k, acts in written.items() if acts):
            job.note(p + key, "DeepSpeed's fp16 optimizer without ZeRO halves the loss scale at every overflow "
                              "(its hysteresis acts under ZeRO stages 1-3), and so does tessera's mapping")
    job.put("precision.min_loss_scale", read_num(fp16, "min_loss_scale", 1, p), p + "min_loss_scale")
    return "fp16"


def zero_stage(ds: dict) -> int:
    """The ZeRO stage a DeepSpeed config asks for (0 without a zero_optimization section)."""
    z = ds.get("zero_optimization", {})
    if isinstance(z, bool):  # DeepSpeed's deprecated form: true is stage 1
        return int(z)
    return read_int(read_section(ds, "zero_optimization"), "stage", 0, "zero_optimization.")


def map_zero(ds: dict, job, dtype: str, reduce_dtype: str) -> None:
    """``zero_optimization`` → parallel.zero_stage, [zero] offload and buckets (elements → MiB at the gradient
    reduction dtype's bytes for reduce_bucket_size, the parameters' for allgather_bucket_size)."""
    if isinstance(ds.get("zero_optimization"), bool):  # DeepSpeed's deprecated form: true is stage 1
        job.put("parallel.zero_stage", int(ds["zero_optimization"]), "zero_optimization")
        return
    z, p = read_section(ds, "zero_optimization"), "zero_optimization."
    if not z:
        return
    stage = read_int(z, "stage", 0, p, minimum=0)
    if stage > 3:
        raise ConfigError(f"deepspeed key '{p}stage' must be 0 to 3 ('Maximum supported ZeRO stage is 3'), "
                          f"got {stage}")
    job.put("parallel.zero_stage", stage, p + "stage")
    _map_offload(z, job, stage)
    width = {"fp32": 4, "bf16": 2, "fp16": 2}
    if "reduce_bucket_size" in z:
        elements = read_int(z, "reduce_bucket_size", None, p, minimum=1)
        job.put("zero.bucket_mb", elements * width[reduce_dtype] / MB, p + "reduce_bucket_size")
    if "allgather_bucket_size" in z:
        elements = read_int(z, "allgather_bucket_size", None, p, minimum=0)
        job.put("zero.allgather_bucket_mb", elements * width[dtype] / MB, p + "allgather_bucket_size")
    for key, ours in (("stage3_prefetch_bucket_size", "zero.prefetch_params"),
                      ("stage3_max_live_parameters", "zero.max_live_params")):
        if key not in z:
            continue
        value = read_int(z, key, None, p, minimum=0)
        if stage == 3:
            job.put(ours, value, p + key)
        else:
            job.note(p + key, f"it applies only to ZeRO-3, but zero_optimization.stage={stage}")


def _map_offload(z: dict, job, stage: int) -> None:
    """offload_optimizer / offload_param (and the legacy cpu_offload / cpu_offload_param) → zero.offload:
    "disk" if either asks for nvme, else "host" if either asks for cpu. tessera's offload moves the fp32
    masters, the optimizer state and, at ZeRO-3, the parameter shards together (docs/OFFLOAD.md)."""
    p = "zero_optimization."
    opt, par = read_section(z, "offload_optimizer", p), read_section(z, "offload_param", p)
    opt_dev = read_choice(opt, "device", "none", OFFLOAD_DEVICES, p + "offload_optimizer.")
    par_dev = read_choice(par, "device", "none", OFFLOAD_DEVICES, p + "offload_param.")
    if read_bool(z, "cpu_offload", False, p) and opt_dev == "none":
        opt_dev = "cpu"
    if read_bool(z, "cpu_offload_param", False, p) and par_dev == "none":
        par_dev = "cpu"
    if par_dev != "none" and stage < 3:
        job.note(p + "offload_param", f"it applies only to ZeRO-3, but zero_optimization.stage={stage}")
        par_dev = "none"
    devices = (opt_dev, par_dev)
    mode = "disk" if "nvme" in devices else "host" if "cpu" in devices else "none"
    if mode == "none":
        return
    source = p + ("offload_optimizer" if opt_dev != "none" else "offload_param")
    job.put("zero.offload", mode, source)
    if mode == "disk":
        nvme = opt if opt_dev == "nvme" else par
        if "nvme_path" in nvme:
            where = "offload_optimizer" if opt_dev == "nvme" else "offload_param"
            job.put("zero.offload_dir", read_text(nvme, "nvme_path", p + where + "."), f"{p}{where}.nvme_path")
    if stage == 3 and opt_dev != par_dev:
        job.notes.append(f"tessera: note: deepspeed's offload_optimizer '{opt_dev}' with offload_param "
                         f"'{par_dev}' maps to zero.offload='{mode}', which moves the fp32 master weights, the "
                         f"optimizer state and the parameter shards together (the same results)")


# ---- typed reads: one sentence naming the DeepSpeed key on a wrong value ------------------------------


def _bad(where: str, what: str, value) -> ConfigError:
    if value == "auto":  # Hugging Face's Trainer fills these in before DeepSpeed reads the file
        return ConfigError(f"deepspeed key '{where}' is \"auto\", a placeholder the Hugging Face Trainer fills "
                           f"in; write its value")
    return ConfigError(f"deepspeed key '{where}' must be {what}, got {json.dumps(value)}")


def read_section(ds: dict, key: str, prefix: str = "") -> dict:
    value = ds.get(key, {})
    if not isinstance(value, dict):
        raise _bad(prefix + key, "an object", value)
    return value


def read_num(ds: dict, key: str, default, prefix: str = "", minimum: float | None = None) -> float:
    if key not in ds:
        return default
    value = ds[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (minimum is not None and value < minimum):
        raise _bad(prefix + key, "a number" + ("" if minimum is None else f" of at least {minimum}"), value)
    return float(value)


def read_int(ds: dict, key: str, default, prefix: str = "", minimum: int | None = None) -> int:
    if key not in ds:
        return default
    value = ds[key]
    if isinstance(value, float) and value.is_integer():  # JSON's 5e7 (DeepSpeed reads it as an integer)
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise _bad(prefix + key, "an integer" + ("" if minimum is None else f" of at least {minimum}"), value)
    return value


def read_bool(ds: dict, key: str, default, prefix: str = "") -> bool:
    if key not in ds:
        return default
    if not isinstance(ds[key], bool):
        raise _bad(prefix + key, "true or false", ds[key])
    return ds[key]


def read_choice(ds: dict, key: str, default, choices, prefix: str = "") -> str:
    """``ds[key]``, one of ``choices``; ``default`` when absent (None: the key is required)."""
    if key not in ds and default is None:
        raise ConfigError(f"deepspeed key '{prefix}{key}' is missing: give one of {', '.join(choices)}")
    value = ds.get(key, default)
    if not isinstance(value, str) or value not in choices:
        raise _bad(prefix + key, "one of " + ", ".join(choices), value)
    return value


def read_text(ds: dict, key: str, prefix: str = "") -> str:
    if not isinstance(ds[key], str) or not ds[key]:
        raise _bad(prefix + key, "a non-empty string", ds[key])
    return ds[key]
