"""The job configuration: one small dataclass per component, loaded from TOML plus overrides.

    [run]        name, output folder, seed, local ranks, device, progress bar
    [model]      a preset (tiny, small, moe-small, 124M, 1B, 7B, 70B, ctr) and any field of ModelConfig
    [parallel]   degrees dp_replicate, dp_shard, pp, tp, cp, ep; rank order; collective timeout
    [ddp]        gradient bucket size, unused-parameter handling; mode (DDP, local SGD, parameter servers, DataParallel)
    [optim]      optimizer (AdamW, Adam, SGD, Adagrad), warm-up + lr schedule, gradient clipping
    [data]       corpus, sequence length, global and micro batch sizes
    [train]      steps, logging and validation cadence
    [checkpoint] final checkpoint
    [zero]       ZeRO buckets, CPU offload, ZeRO-3 units (the stage is parallel.zero_stage)
    [precision]  parameter/compute dtype, gradient-reduction dtype, loss scaling
    [checkpointing] activation checkpointing: none, full or selective, every k-th block
    [ps]         parameter-server mode (model.preset = "ctr"): roles, BSP/ASP/SSP, row-wise optimizer
    [moe] [tensor_parallel] [context_parallel] [pipeline]   options of those strategies
    [lora]       low-rank adapters: rank (0 = off), alpha, dropout, target linear layers; the rest frozen
    [profile]    torch.profiler traces of chosen steps (tessera.observe.profile)
    [kernels]    implementations of hot operations: fused/foreach AdamW, F.rms_norm, SDPA GQA, torch.compile

Defaults (these dataclasses'): the ``small`` preset on the standard-library corpus with data parallelism
over the local ranks; ``tessera train`` given no layout at all runs the 3D demo instead (tessera.cli).
Validation refuses, with one sentence, anything that cannot run, any non-finite number, and any key the
user set that the resolved job would not use (:mod:`tessera.train.settings`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from tessera.composition import validate_composition
from tessera.context_parallel.config import ContextParallelConfig
from tessera.data_parallel.config import DDPConfig
from tessera.errors import ConfigError
from tessera.kernels import KernelsConfig
from tessera.kernels.apply import check_kernels
from tessera.lora.config import LoRAConfig
from tessera.models import ModelConfig, model_config
from tessera.models.moe import MoEConfig, validate_moe
from tessera.parameter_server.config import PSConfig
from tessera.pipeline.config import PipelineConfig
from tessera.precision.config import PrecisionConfig
from tessera.recompute.config import RecomputeConfig
from tessera.tensor_parallel.config import TensorParallelConfig
from tessera.topology import ParallelConfig, validate_degrees
from tessera.train import config_io
from tessera.train.data import DataConfig, check_vocabulary
from tessera.train.dp_modes.registry import validate_modes
from tessera.train.optim import OptimConfig
from tessera.observe.profile import ProfileConfig
from tessera.train.settings import check_finite, check_settings_take_effect
from tessera.zero.config import ZeroConfig
from tessera.zero.offload.check import check_disk_offload
from tessera.zero.validate import validate_memory_savers
from tessera.train.wrap_check import check_wrap_config


@dataclass
class RunConfig:
    name: str = ""  # the run folder is <out_dir>/<name>; empty: "<preset>-<layout>"; a taken name gets a suffix
    out_dir: str = "runs"
    seed: int = 0  # model initialisation (data order has its own seed in [data])
    nproc: int = 2  # local ranks to spawn when not launched by torchrun
    device: str = "cpu"  # "cpu", "cuda" or "auto" (an accelerator when present)
    progress: bool = True  # progress bar on rank 0
    max_restarts: int = 0  # elastic restarts of the local ranks tessera spawns (under torchrun: --max-restarts)
    check_memory: bool = True  # refuse, before launch, a job whose predicted peak memory per rank exceeds the machine's
    tensorboard: bool = False  # rank 0 also writes TensorBoard event files in <run_dir>/tensorboard (the tensorboard extra)
    peak_flops: float = 0.0  # one device's peak FLOP/s for metrics' mfu; 0: the planner's GPU catalogue (null on a CPU)

    def validate(self) -> RunConfig:
        if self.nproc < 1:
            raise ConfigError(f"run.nproc must be at least 1, got {self.nproc}")
        if self.max_restarts < 0:
            raise ConfigError(f"run.max_restarts must be 0 or more, got {self.max_restarts}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"run.device must be 'cpu', 'cuda' or 'auto', got '{self.device}'")
        if "/" in self.name or self.name in (".", ".."):
            raise ConfigError(f"run.name '{self.name}' must be a plain folder name")
        if self.peak_flops < 0:  # nan / inf: check_finite
            raise ConfigError(f"run.peak_flops must be a FLOP/s rate, 0 or more, got {self.peak_flops}")
        if self.tensorboard:
            from tessera.observe.tensorboard import check_available

            check_available()
        return self


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps
    log_every: int = 10  # a metrics.jsonl line every this many steps
    eval_every: int = 50  # validation loss every this many steps (and at the first and last)
    time_breakdown: bool = False  # time_forward/backward/optimizer/comm_wait per metrics line (syncs the device)

    def validate(self) -> TrainConfig:
        for key in ("steps", "log_every", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} must be at least 1, got {getattr(self, key)}")
        return self


@dataclass
class CheckpointConfig:
    save_final: bool = True  # model + optimizer + data position at the end, via torch.distributed.checkpoint
    folder: str = "checkpoint"  # inside the run folder; each checkpoint is a step_<n> folder in it
    every: int = 0  # also save every this many steps (0: only the final one)
    keep: int = 2  # periodic checkpoints kept (the newest); the final one is always kept
    resume: str = ""  # "": start fresh; "auto": newest checkpoint of this run's folder, if any; or a path

    def validate(self) -> CheckpointConfig:
        if self.every < 0 or self.keep < 1:
            raise ConfigError(f"checkpoint.every must be 0 or more and checkpoint.keep at least 1, got "
                              f"{self.every} and {self.keep}")
        if "/" in self.folder or self.folder in ("", ".", ".."):
            raise ConfigError(f"checkpoint.folder '{self.folder}' must be a plain folder name")
        return self


@dataclass
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=lambda: model_config("small"))
    model_preset: str = "small"  # written as model.preset ("hf" when model.hf gives the model)
    model_hf: str = ""  # written as model.hf: a Hugging Face folder the model and its initial weights come from
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpointing: RecomputeConfig = field(default_factory=RecomputeConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    # "section.key" -> value for every key the user gave (TOML or override) that differs from its default;
    # filled by load_config (empty for a config built in code), read by settings.check_settings_take_effect
    explicit: dict = field(default_factory=dict)


SECTIONS = {
    "run": RunConfig, "model": ModelConfig, "parallel": ParallelConfig, "ddp": DDPConfig,
    "optim": OptimConfig, "data": DataConfig, "train": TrainConfig, "checkpoint": CheckpointConfig,
    "zero": ZeroConfig, "precision": PrecisionConfig, "checkpointing": RecomputeConfig,
    "ps": PSConfig, "moe": MoEConfig, "tensor_parallel": TensorParallelConfig,
    "context_parallel": ContextParallelConfig, "pipeline": PipelineConfig, "lora": LoRAConfig,
    "profile": ProfileConfig, "kernels": KernelsConfig,
}
# presets that are not a Transformer: their [model] keys are ignored and their own section configures them
NON_TRANSFORMER_PRESETS = ("ctr",)  # ctr: the wide & deep CTR model of the parameter-server mode, see [ps]
HF_PRESET = "hf"  # model.preset of a job whose model comes from model.hf (tessera.hf.job)


def load_config(path: str | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults ← TOML file ← ``--section.key=value`` overrides; types and key names checked.

    ``explicit`` of the result records the keys given that differ from their defaults (for ``[model]``,
    the preset's values), so validation can refuse the ones the job would not use. ``data.seq_len``
    left unset is 128, or the model's ``max_seq_len`` when that is shorter."""
    raw = config_io.merge(config_io.read_toml(path) if path else {},
                          config_io.parse_overrides(overrides or []))
    config_io.check_sections(raw, SECTIONS)
    hf = str(raw.get("model", {}).get("hf", ""))
    preset = str(raw.get("model", {}).get("preset", HF_PRESET if hf else "small"))
    # with model.hf the defaults are the folder's model: a key repeating its value is not the user's choice
    base = {"model": {"hf": hf}} if hf else {}
    if hf and not Path(hf).expanduser().is_dir():  # a run's saved config without the folder: its keys are the model
        base = {"model": raw["model"]}
    cfg, defaults = _build(raw, preset), _build(base, preset)
    given = [(section, key) for section, values in raw.items() for key in values
             if (section, key) not in (("model", "preset"), ("model", "hf"))]
    cfg.explicit = {f"{section}.{key}": getattr(getattr(cfg, section), key) for section, key in given
                    if getattr(getattr(cfg, section), key) != getattr(getattr(defaults, section), key)}
    return cfg


def _build(raw: dict, preset: str) -> JobConfig:
    model_raw = {k: v for k, v in raw.get("model", {}).items() if k not in ("preset", "hf")}
    hf = str(raw.get("model", {}).get("hf", ""))
    sections = {name: cls(**config_io.check_keys(name, raw.get(name, {}), cls))
                for name, cls in SECTIONS.items() if name != "model"}
    model_keys = config_io.check_keys("model", model_raw, ModelConfig)
    if hf or preset == HF_PRESET:
        model, sections["moe"], hf = _hf_model(hf, preset, model_keys, raw.get("moe", {}))
    else:
        model = model_config("small" if preset in NON_TRANSFORMER_PRESETS else preset, **model_keys)
    if sections["data"].tokenizer not in ("byte", ""):  # absolute, so the run's config.toml works from anywhere
        sections["data"].tokenizer = str(Path(sections["data"].tokenizer).expanduser().resolve())
    if "seq_len" not in raw.get("data", {}):  # the default fits the model (the tiny preset's 64 tokens)
        sections["data"].seq_len = min(sections["data"].seq_len, model.max_seq_len)
    return JobConfig(model=model, model_preset=preset, model_hf=hf, **sections)


def _hf_model(hf: str, preset: str, model_keys: dict, moe_raw: dict) -> tuple[ModelConfig, MoEConfig, str]:
    """model.hf: (model, moe, the folder as an absolute path) from a Hugging Face folder (tessera.hf.job)."""
    if not hf:
        raise ConfigError(f"model.preset={HF_PRESET!r} needs model.hf=DIR, a Hugging Face model folder")
    if preset != HF_PRESET:
        raise ConfigError(f"model.preset={preset!r} and model.hf both choose the model; give one of them")
    from tessera.hf.job import job_model

    model, moe = job_model(hf, model_keys, config_io.check_keys("moe", moe_raw, MoEConfig))
    return model, moe, str(Path(hf).expanduser().resolve())


def validate_config(cfg: JobConfig, world_size: int) -> JobConfig:
    """Every check that can be made before a process starts; raises ConfigError with one sentence."""
    check_finite(cfg, SECTIONS)
    if cfg.model_preset in NON_TRANSFORMER_PRESETS:  # the parameter-server job reads [ps], [run], [train]
        for name in ("run", "train", "ps"):
            getattr(cfg, name).validate()
        check_settings_take_effect(cfg, cfg.parallel)
        return cfg
    for name in SECTIONS:
        getattr(cfg, name).validate()
    if cfg.model_hf:  # the safetensors headers match the model (a job built in code is checked here too)
        from tessera.hf.job import check_weights

        check_weights(cfg.model_hf, cfg.model, cfg.moe)
    if cfg.lora.enabled and cfg.lora.init_from:  # the adapter's tensor names and shapes fit the model
        from tessera.lora.peft import check_init_from

        check_init_from(cfg.lora, cfg.model, cfg.moe)
    validate_degrees(cfg.parallel, world_size)
    cfg.profile.check_steps(cfg.train.steps)  # traced steps are steps the run takes
    check_vocabulary(cfg.data, cfg.model.vocab_size)  # the data's tokenizer fits the model's vocabulary
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}"
        )
    dp = cfg.parallel.resolved(world_size)
    dp_size = dp.dp_replicate * dp.dp_shard
    if cfg.data.global_batch_size % (cfg.data.micro_batch_size * dp_size):
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} is not divisible by "
            f"data.micro_batch_size={cfg.data.micro_batch_size} × data-parallel degree {dp_size}"
        )
    validate_memory_savers(cfg)
    check_disk_offload(cfg, dp, world_size)  # zero.offload="disk": the folder and the room on its disk
    validate_strategies(cfg, dp)
    if cfg.checkpoint.resume == "auto" and not cfg.run.name:
        raise ConfigError("checkpoint.resume=auto needs run.name, so that a restarted job finds its run folder")
    if cfg.checkpoint.resume not in ("", "auto") and not Path(cfg.checkpoint.resume).is_dir():
        raise ConfigError(f"checkpoint.resume: no checkpoint folder at {cfg.checkpoint.resume}")
    check_settings_take_effect(cfg, dp)
    check_wrap_config(cfg, dp)  # zero.wrap_paths / wrap_classes name modules of the model as it runs (LoRA, tp, ep)
    check_lora(cfg, dp)
    return cfg


def check_lora(cfg: JobConfig, parallel: ParallelConfig) -> None:
    """A ``[lora]`` key other than the rank acts only with adapters (lora.rank > 0): refused otherwise, as
    every key without effect is (``tessera.train.settings``)."""
    given = [key for key in cfg.explicit if key.startswith("lora.") and key != "lora.rank"]
    if given and not cfg.lora.enabled:
        raise ConfigError(f"{given[0]}={cfg.explicit[given[0]]!r} has no effect in this job: it applies only with "
                          f"adapters (lora.rank > 0), but lora.rank=0; remove it or set lora.rank")


def validate_strategies(cfg: JobConfig, parallel: ParallelConfig) -> None:
    """Shape checks of tensor, context, pipeline and expert parallelism (``parallel`` is resolved)."""
    validate_composition(cfg, parallel)
    validate_modes(cfg, parallel)  # ddp.mode other than DDP: what it cannot compose with, and why
    check_kernels(cfg, parallel)  # a [kernels] choice the layout has no operation for
    m, tp = cfg.model, parallel.tp
    cfg.tensor_parallel.validate(tp, m, cfg.data.seq_len)
    cfg.context_parallel.check_shapes(parallel.cp, cfg.data.seq_len, m.n_heads // tp, m.n_kv_heads // tp,
                                      m.dropout)
    validate_moe(cfg.moe, m.num_experts, parallel.ep)
    per_rank_batch = cfg.data.global_batch_size // (parallel.dp_replicate * parallel.dp_shard)
    cfg.pipeline.validate(parallel.pp, m.n_layers, per_rank_batch, routing_losses=m.num_experts > 0,
                          dynamic_loss_scale=cfg.precision.loss_scale == "dynamic" or (
                              cfg.precision.loss_scale == "auto" and cfg.precision.dtype == "fp16"))


def config_dict(cfg: JobConfig) -> dict:
    """The resolved config as TOML-ready sections (model.preset included)."""
    out = {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}
    out["model"] = {"preset": cfg.model_preset, **({"hf": cfg.model_hf} if cfg.model_hf else {}), **out["model"]}
    return out


def save_config(cfg: JobConfig, path: Path) -> None:
    path.write_text(tomli_w.dumps(config_dict(cfg)), encoding="utf-8")
