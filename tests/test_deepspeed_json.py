"""``tessera train --deepspeed``: DeepSpeed configs as they are written map onto tessera's keys.

The seed's config and DeepSpeed's documented examples (written here as dicts) map to the expected
JobConfig; DeepSpeed's batch rule is DeepSpeed's own (checked against deepspeed.runtime.config where the
package is installed); unknown keys and values tessera cannot reproduce are refused with one sentence;
and a 2-rank run from a DeepSpeed config equals the same job given as tessera overrides.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.cli import main, resolve_job
from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.train.config import load_config, validate_config
from tessera.train.deepspeed_json import batch_sizes, read_deepspeed
from tessera.train.deepspeed_keys import KEYS

ROOT = Path(__file__).resolve().parent.parent
MB = 2**20

# seed 001's config (a CIFAR example), as written there
SEED = {
    "train_batch_size": 16, "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": False, "bf16": {"enabled": False},
    "fp16": {"enabled": True, "fp16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True,
                          "contiguous_gradients": True, "cpu_offload": True},
}
# DeepSpeed's getting-started example (batch keys, the deprecated "zero_optimization": true)
GETTING_STARTED = {"train_batch_size": 8, "gradient_accumulation_steps": 1,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
                   "fp16": {"enabled": True}, "zero_optimization": True}
# the ZeRO tutorial's ZeRO-2 with optimizer offload, and its ZeRO-3 (ZeRO-Infinity) example with stage3_* keys
ZERO2_OFFLOAD = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                       "contiguous_gradients": True, "overlap_comm": True}}
ZERO3 = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
         "zero_optimization": {"stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
                               "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
                               "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
                               "sub_group_size": 1e9, "offload_optimizer": {"device": "cpu"},
                               "offload_param": {"device": "cpu"}}}
# the config-json page's fp16 and activation_checkpointing sections
FP16_DYNAMIC = {"train_batch_size": 8, "fp16": {
    "enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
    "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}}
CHECKPOINTING = {"train_batch_size": 8, "activation_checkpointing": {
    "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
    "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}}


def mapped(ds: dict, world: int = 2, extra=(), user_keys=frozenset()):
    """(JobConfig, notes) as ``tessera train --deepspeed`` builds them for ``world`` ranks, validated."""
    job = read_deepspeed(ds)
    cfg = load_config(None, [*job.overrides, f"--run.nproc={world}", *extra])
    notes = job.notes + job.settle(cfg, world, user_keys)
    validate_config(cfg, world)
    return cfg, notes


def noted(notes: list[str]) -> set[str]:
    return {n.split("'")[1] for n in notes if n.startswith("tessera: note: deepspeed key '")}


def test_seed_config_maps_to_its_tessera_job():
    cfg, notes = mapped(SEED)
    assert (cfg.data.global_batch_size, cfg.data.micro_batch_size) == (16, 8)  # 16 = 8 × 1 × dp 2
    o = cfg.optim
    assert (o.name, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay) == ("adamw", 0.001, 0.8, 0.999, 1e-8, 3e-7)
    assert (o.schedule, o.warmup_steps, o.warmup_type, o.warmup_min_ratio) == ("deepspeed-warmup", 1000, "log", 0.0)
    assert (o.grad_clip, cfg.train.log_every, cfg.train.time_breakdown) == (1.0, 2000, False)
    p = cfg.precision
    assert (p.dtype, p.loss_scale, p.init_scale, p.growth_interval, p.growth_delay) == ("fp16", "auto", 2.0**15, 500, 1)
    assert (p.hysteresis, p.min_loss_scale) == (2, 1.0)
    assert (cfg.parallel.zero_stage, cfg.zero.offload) == (2, "host")
    assert cfg.zero.bucket_mb == cfg.zero.allgather_bucket_mb == 50_000_000 * 2 / MB  # fp16 elements
    assert noted(notes) == {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                            "zero_optimization.allgather_partitions"}


def test_getting_started_example_and_deepspeed_defaults():
    """Silent keys take DeepSpeed's defaults where they change results: no clipping, a constant lr, fp16's
    dynamic scaler; the deprecated ``"zero_optimization": true`` is stage 1."""
    cfg, notes = mapped(GETTING_STARTED)
    assert (cfg.data.global_batch_size, cfg.data.micro_batch_size) == (8, 4)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.beta1, cfg.optim.beta2, cfg.optim.weight_decay) == \
        ("adamw", 0.00015, 0.9, 0.999, 0.0)
    assert (cfg.optim.grad_clip, cfg.optim.schedule, cfg.optim.warmup_steps) == (0.0, "constant", 0)
    p = cfg.precision
    assert (p.dtype, p.init_scale, p.growth_interval, p.hysteresis, p.min_loss_scale) == \
        ("fp16", 65536.0, 1000, 2, 1.0)
    assert cfg.parallel.zero_stage == 1 and notes == []


def test_zero2_offload_and_zero3_examples():
    cfg, notes = mapped(ZERO2_OFFLOAD)
    assert (cfg.parallel.zero_stage, cfg.zero.offload, cfg.precision.dtype) == (2, "host", "bf16")
    assert (cfg.data.micro_batch_size, cfg.data.global_batch_size) == (4, 8)  # micro × 1 × dp 2
    assert noted(notes) == {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients"}
    cfg, notes = mapped(ZERO3)
    assert (cfg.parallel.zero_stage, cfg.zero.offload) == (3, "host")
    assert (cfg.zero.prefetch_params, cfg.zero.max_live_params) == (10_000_000, 1_000_000_000)
    assert cfg.zero.bucket_mb == 1e7 * 4 / MB  # fp32 gradients
    assert (cfg.data.global_batch_size, cfg.data.micro_batch_size) == (16, 2)  # gas 4 at dp 2
    assert noted(notes) >= {"zero_optimization.stage3_max_reuse_distance", "zero_optimization.sub_group_size",
                            "zero_optimization.stage3_param_persistence_threshold"}


def test_offload_devices():
    """nvme → disk offload in nvme_path; offload_param is ZeRO-3's only; one device for both at ZeRO-3."""
    def offload(stage, **zero):
        job = read_deepspeed({"zero_optimization": {"stage": stage, **zero}})
        return [o for o in job.overrides if o.startswith("--zero.")], job.notes

    assert offload(1, offload_optimizer={"device": "nvme", "nvme_path": "/nvme"})[0] == \
        ["--zero.offload=disk", "--zero.offload_dir=/nvme"]
    over, notes = offload(2, offload_param={"device": "cpu"})
    assert over == [] and noted(notes) == {"zero_optimization.offload_param"}
    over, notes = offload(3, offload_param={"device": "cpu"})
    assert over == ["--zero.offload=host"] and "moves the fp32 master weights" in notes[0]
    assert offload(3, offload_optimizer={"device": "none"})[0] == []


def test_fp16_sections():
    cfg, notes = mapped(FP16_DYNAMIC)  # no ZeRO: DeepSpeed's FP16 optimizer halves at every overflow
    assert (cfg.precision.init_scale, cfg.precision.growth_interval, cfg.precision.hysteresis) == (65536.0, 1000, 1)
    assert noted(notes) == {"fp16.auto_cast", "fp16.hysteresis"}
    cfg, notes = mapped({**FP16_DYNAMIC, "zero_optimization": {"stage": 1}})  # ZeRO: DynamicLossScaler's hysteresis
    assert (cfg.precision.hysteresis, cfg.precision.consecutive_hysteresis) == (2, False)
    assert noted(notes) == {"fp16.auto_cast"}
    cfg, _ = mapped({"train_batch_size": 8, "zero_optimization": {"stage": 2},
                     "fp16": {"enabled": True, "consecutive_hysteresis": True}})
    assert (cfg.precision.hysteresis, cfg.precision.consecutive_hysteresis) == (2, True)
    cfg, notes = mapped({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 4}})
    assert (cfg.precision.dtype, cfg.precision.loss_scale, cfg.precision.hysteresis) == ("fp16", "128.0", 1)
    assert noted(notes) == {"fp16.hysteresis"}  # a static scale: DeepSpeed ignores the dynamic keys
    cfg, _ = mapped({"train_batch_size": 8, "bf16": {"enabled": True}, "fp16": {"enabled": False}})
    assert cfg.precision.dtype == "bf16"
    with pytest.raises(ConfigError, match="simultaneously"):
        read_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="fp32 master weights"):
        read_deepspeed({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}})


def test_each_scheduler():
    opt = {"type": "AdamW", "params": {"lr": 3e-4}}
    decay = {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_min_lr": 1e-5,
                                                  "warmup_max_lr": 2e-4, "warmup_num_steps": 10,
                                                  "warmup_type": "linear"}}
    cfg, _ = mapped({"train_batch_size": 8, "optimizer": opt, "scheduler": decay})
    o = cfg.optim
    assert (o.schedule, o.lr, o.warmup_steps, o.warmup_type, o.total_steps) == \
        ("deepspeed-warmup-decay", 2e-4, 10, "linear", 100)
    assert o.warmup_min_ratio == o.min_lr_ratio == pytest.approx(0.05)  # it decays back to warmup_min_lr
    cosine = {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_min_ratio": 0.1,
                                                    "cos_min_ratio": 0.01, "warmup_num_steps": 1}}
    cfg, _ = mapped({"train_batch_size": 8, "optimizer": opt, "scheduler": cosine})
    o = cfg.optim
    assert (o.schedule, o.lr, o.warmup_steps, o.warmup_type, o.total_steps, o.warmup_min_ratio, o.min_lr_ratio) == \
        ("deepspeed-warmup-cosine", 3e-4, 2, "log", 100, 0.1, 0.01)  # DeepSpeed's floor of 2 warm-up steps
    with pytest.raises(ConfigError, match="total_num_steps"):
        read_deepspeed({"scheduler": {"type": "WarmupDecayLR", "params": {}}})
    with pytest.raises(ConfigError, match="'scheduler.type'"):
        read_deepspeed({"scheduler": {"type": "OneCycle", "params": {}}})


SCHEDULER_SECTIONS = [  # each of DeepSpeed's schedulers as its documentation writes it, and none
    None,
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_num_steps": 1, "warmup_type": "linear"}},
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                         "warmup_num_steps": 10}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_min_ratio": 0, "warmup_num_steps": 10,
                                          "cos_min_ratio": 0.0001}},
]
FP16_SECTIONS = [  # static and dynamic scales, every dynamic key written, consecutive hysteresis on and off
    {"enabled": True, "loss_scale": 128, "initial_scale_power": 12, "loss_scale_window": 100, "hysteresis": 4,
     "consecutive_hysteresis": True, "min_loss_scale": 2},
    {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 100, "hysteresis": 4,
     "consecutive_hysteresis": True, "min_loss_scale": 2},
    {"enabled": True, "loss_scale": 0, "hysteresis": 1, "consecutive_hysteresis": True},
    {"enabled": False, "loss_scale": 0, "hysteresis": 3},
]


@pytest.mark.parametrize("scheduler", SCHEDULER_SECTIONS)
@pytest.mark.parametrize("fp16", FP16_SECTIONS)
@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("opt", ["AdamW", "SGD", "Adagrad"])
def test_mapped_configs_pass_every_scope_row(scheduler, fp16, stage, opt):
    """No mapped key is refused by settings.py's Scope rows: a key the mapped job does not use (min_lr_ratio or
    total_steps without a decay, hysteresis with a static scale or hysteresis 1, momentum outside SGD, ...)
    becomes a note. ``mapped`` settles and validates the whole config."""
    ds = {"train_batch_size": 8, "optimizer": {"type": opt, "params": {"lr": 1e-3}}, "fp16": fp16,
          "zero_optimization": {"stage": stage}}
    if scheduler is not None:
        ds["scheduler"] = scheduler
    cfg, notes = mapped(ds)
    p = cfg.precision
    dynamic = fp16["enabled"] and fp16["loss_scale"] == 0
    assert p.growth_delay == (1 if dynamic else 0)
    assert p.consecutive_hysteresis == (dynamic and stage > 0 and fp16["hysteresis"] > 1)
    if fp16["enabled"] and not dynamic:
        assert {"fp16.hysteresis", "fp16.consecutive_hysteresis"} <= noted(notes)
    if scheduler is not None:
        assert cfg.optim.schedule.startswith("deepspeed-warmup") and cfg.optim.warmup_steps >= 2


@pytest.mark.parametrize("opt, expected", [
    ({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}, ("adam", 0.01)),
    ({"type": "adamw", "params": {"adam_w_mode": False}}, ("adamw", 0.0)),  # AdamW is decoupled whatever the flag
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, ("sgd", 0.0)),
    ({"type": "Adagrad", "params": {"lr": 0.05}}, ("adagrad", 0.0)),
])
def test_optimizer_types(opt, expected):
    job = read_deepspeed({"optimizer": opt})
    cfg = load_config(None, job.overrides)
    assert (cfg.optim.name, cfg.optim.weight_decay) == expected
    if expected[0] == "sgd":
        assert (cfg.optim.lr, cfg.optim.momentum, cfg.optim.nesterov) == (0.1, 0.9, True)


@pytest.mark.parametrize("ds, words", [
    ({"zero_optimization": {"stage": 2, "foo": 1}}, "deepspeed key 'zero_optimization.foo' is not one"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer type 'Lamb' is not one tessera offers"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}, "does not apply to optimizer type 'SGD'"),
    ({"activation_checkpointing": {"partition_activations": True}}, "partition_activations'=true cannot"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "quantised gradients"),
    ({"gradient_accumulation_steps": 2}, "Either train_batch_size"),
    ({"train_batch_size": "auto"}, "placeholder the Hugging Face Trainer"),
])
def test_refused_with_one_sentence(ds, words):
    with pytest.raises(ConfigError) as err:
        job = read_deepspeed(ds)
        job.settle(load_config(None, job.overrides), 2)
    assert words in str(err.value) and "\n" not in str(err.value)


# (train, micro, gas) as given, the data-parallel size, DeepSpeed's resolved (train, micro, gas)
BATCHES = [((16, None, None), 2, (16, 8, 1)), ((32, 4, None), 2, (32, 4, 4)), ((32, None, 2), 4, (32, 4, 2)),
           ((None, 4, 3), 2, (24, 4, 3)), ((None, 4, None), 4, (16, 4, 1)), ((32, 4, 4), 2, (32, 4, 4))]
DISAGREE = [((32, 4, 3), 2), ((10, None, None), 4), ((16, 4, None), 8)]


def test_batch_rule_and_refusals():
    for given, dp, expected in BATCHES:
        assert batch_sizes(*given, dp) == expected, given
    for given, dp in DISAGREE:
        with pytest.raises(ConfigError, match="train_batch_size is not equal to micro_batch_per_gpu"):
            batch_sizes(*given, dp)
    with pytest.raises(ConfigError, match=r"32 != 4 \* 3 \* 2"):  # DeepSpeed's own numbers
        mapped({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3})
    # tessera's dp degree is the world over tp × pp × cp; a pipeline runs gas micro-batches per step
    cfg, _ = mapped({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, world=4,
                    extra=["--model.preset=tiny", "--parallel.pp=2", "--parallel.dp_replicate=2"])
    assert (cfg.data.global_batch_size, cfg.data.micro_batch_size, cfg.pipeline.microbatches) == (16, 2, 4)


def test_deepspeed_itself_agrees_on_batch_sizes(deepspeed_cpu):
    """deepspeed.runtime.config.DeepSpeedConfig with a fake data-parallel world size: the same triples, the
    same refusals."""
    from unittest import mock

    from deepspeed.runtime import config as ds_config

    def deepspeed_batch(given, dp):
        ds = {k: v for k, v in zip(("train_batch_size", "train_micro_batch_size_per_gpu",
                                    "gradient_accumulation_steps"), given) if v is not None}
        with mock.patch.object(ds_config.dist, "get_rank", return_value=0), \
                mock.patch.object(ds_config.dist, "get_world_size", return_value=dp):
            c = ds_config.DeepSpeedConfig(ds)
        return c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps

    for given, dp, expected in BATCHES:
        assert deepspeed_batch(given, dp) == expected, given
    for given, dp in DISAGREE:
        with pytest.raises(AssertionError):
            deepspeed_batch(given, dp)


def test_user_overrides_win_and_unused_keys_become_notes():
    job = read_deepspeed(SEED)
    cfg = load_config(None, [*job.overrides, "--optim.lr=0.01", "--data.micro_batch_size=2"])
    job.settle(cfg, 2, user_keys={"optim.lr", "data.micro_batch_size"})
    assert (cfg.optim.lr, cfg.data.micro_batch_size, cfg.data.global_batch_size) == (0.01, 2, 16)
    # stage 0 in fp32: no ZeRO engine, so the bucket size is reported, not refused
    cfg, notes = mapped({"train_batch_size": 8, "zero_optimization": {"stage": 0, "reduce_bucket_size": 1e6}})
    assert cfg.zero.bucket_mb == 25.0 and "zero.bucket_mb" not in cfg.explicit
    assert "deepspeed key 'zero_optimization.reduce_bucket_size' has no effect here: it applies only when a ZeRO" \
        in "\n".join(notes)
    cfg, notes = mapped(CHECKPOINTING)
    assert cfg.checkpointing.mode == "full"
    assert noted(notes) == {"activation_checkpointing.number_checkpoints",
                            "activation_checkpointing.contiguous_memory_optimization",
                            "activation_checkpointing.synchronize_checkpoint_boundary"}


def test_parallel_auto_keeps_its_choices(capsys):
    """parallel.auto plans with train_batch_size and chooses the stage and micro-batch itself: DeepSpeed's
    stage is then a note, and its micro-batch a refusal."""
    base = ["--run.nproc=2", "--model.preset=tiny", "--parallel.auto=true"]
    job = read_deepspeed({"train_batch_size": 16, "zero_optimization": {"stage": 3}})
    cfg = load_config(None, [*job.overrides, *base])
    par = resolve_job(cfg, 2, announce=True, deepspeed=job)
    alone = load_config(None, [*base, "--data.global_batch_size=16"])
    assert par == resolve_job(alone, 2, announce=False)
    assert (cfg.data.micro_batch_size, cfg.data.global_batch_size) == (alone.data.micro_batch_size, 16)
    assert "deepspeed key 'zero_optimization.stage' has no effect here: it applies only when the layout is " \
        "chosen by hand" in capsys.readouterr().err
    job = read_deepspeed({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2})
    cfg = load_config(None, [*job.overrides, *base])
    with pytest.raises(ConfigError, match="parallel.auto=true chooses the micro-batch"):
        job.settle(cfg, 2)


def test_every_table_key_is_documented():
    doc = (ROOT / "docs" / "DEEPSPEED.md").read_text()
    missing = [k for k in KEYS if f"`{k}`" not in doc]
    assert not missing, missing


def test_cli_refuses_an_unknown_key_with_exit_2(tmp_path, capsys):
    """Through ``main`` as ``tessera train --deepspeed f.json --dry-run`` (in-process: a subprocess costs
    seconds of imports on a shared CPU, and takes the same path)."""
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 2, "foo": True}}))
    assert main(["train", "--deepspeed", str(bad), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "tessera: error: deepspeed key 'zero_optimization.foo' is not one tessera implements; remove it "
        "(docs/DEEPSPEED.md lists every key it reads)"]
    bad.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert main(["train", "--deepspeed", str(bad), "--dry-run"]) == 2
    assert "gives the key 'train_batch_size' twice" in capsys.readouterr().err


def test_cli_dry_run_reports_each_note_once(tmp_path, capsys):
    assert main(["train", "--deepspeed", str(ROOT / "configs" / "deepspeed_seed.json"), "--dry-run",
                 "--model.preset=tiny", f"--run.out_dir={tmp_path}"]) == 0
    err = capsys.readouterr().err.splitlines()
    notes = [line for line in err if line.startswith("tessera: note:")]
    assert len(notes) == len(set(notes)) == 3 and not [line for line in err if "error" in line]


# ---- one end-to-end run: the mapping's parity -----------------------------------------------------

E2E = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1, "gradient_clipping": 0.5,
       "optimizer": {"type": "Adam", "params": {"lr": 0.002, "betas": [0.8, 0.99], "weight_decay": 0.01}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0005, "warmup_num_steps": 2,
                                                    "warmup_type": "linear"}},
       "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e5}}
# the same job written by hand as tessera keys (gas = 8 / (2 × dp 2) = 2)
BY_HAND = ["--data.global_batch_size=8", "--data.micro_batch_size=2", "--train.log_every=1", "--optim.grad_clip=0.5",
           "--optim.name=adamw", "--optim.lr=0.002", "--optim.beta1=0.8", "--optim.beta2=0.99", "--optim.eps=1e-8",
           "--optim.weight_decay=0.01", "--optim.schedule=deepspeed-warmup", "--optim.warmup_steps=2",
           "--optim.warmup_type=linear", "--optim.warmup_min_ratio=0.25", "--precision.dtype=bf16", "--parallel.zero_stage=2",
           f"--zero.bucket_mb={1e5 * 2 / MB}"]


def e2e_worker(rank, world_size, ds, args):
    """A rank as ``tessera train [--deepspeed]`` builds it: the mapped overrides, then the user's."""
    job = read_deepspeed(ds) if ds else None
    cfg = load_config(None, [*(job.overrides if job else []), *args])
    resolve_job(cfg, world_size, announce=False, deepspeed=job)
    return run_rank(cfg)


@pytest.mark.multirank
def test_deepspeed_run_equals_the_same_job_as_overrides(rank_pool, tmp_path, corpus_cache):
    base = ["--model.preset=tiny", "--train.steps=2", "--train.eval_every=2", "--data.seq_len=32",
            "--data.eval_batches=1", f"--data.cache_dir={corpus_cache}", f"--run.out_dir={tmp_path}",
            "--run.progress=false", "--run.nproc=2", "--checkpoint.save_final=false"]
    ds = rank_pool.run(e2e_worker, 2, ds=E2E, args=[*base, "--run.name=ds"])
    ours = rank_pool.run(e2e_worker, 2, ds=None, args=[*base, *BY_HAND, "--run.name=ours"])

    def losses(name):
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["lr"]) for r in lines if r["kind"] == "train"]

    assert len(losses("ds")) == 2 and losses("ds") == losses("ours")
    # a train line (steps 1, 2 counted from 1) holds the lr set after its step: DeepSpeed's iterations 0 and 1
    # (warmup_min_lr, then + Δ/2), the lr of 0-based steps 1 and 2; step 0 ran at iteration -1's warmup_min_lr
    assert [lr for _, _, lr in losses("ds")] == [0.0005, 0.00125]
    assert ds[0]["val_loss_end"] == ours[0]["val_loss_end"]
