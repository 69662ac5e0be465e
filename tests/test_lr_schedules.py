"""Learning-rate schedules (tessera.train.schedules): the default cosine bit for bit as it always was, the
other shapes against their closed forms, the DeepSpeed forms against DeepSpeed's own scheduler classes,
and the one-sentence refusals."""

import math

import pytest
import torch

from tessera.errors import ConfigError
from tessera.train.optim import OptimConfig, build_scheduler, lr_factor


def cosine_of_old(step, cfg, total):
    """The multiplier tessera used before [optim] schedule existed (copied from the old optim.py)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(total - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


@pytest.mark.parametrize("warmup,total", [(0, 10), (1, 1), (3, 12), (30, 200)])
def test_default_cosine_is_bit_identical_to_the_old_schedule(warmup, total):
    cfg = OptimConfig(warmup_steps=warmup)
    assert [lr_factor(k, cfg, total) for k in range(total + 3)] == \
        [cosine_of_old(k, cfg, total) for k in range(total + 3)]


def test_linear_constant_and_wsd_closed_forms():
    w, t, r = 4, 20, 0.1
    lin = OptimConfig(schedule="linear", warmup_steps=w, min_lr_ratio=r)
    assert [lr_factor(k, lin, t) for k in range(w)] == [(k + 1) / w for k in range(w)]
    for k in range(w, t):
        assert lr_factor(k, lin, t) == pytest.approx(r + (1 - r) * (t - 1 - k) / (t - w))
    assert lr_factor(t - 1, lin, t) == pytest.approx(r) and lr_factor(t + 5, lin, t) == pytest.approx(r)
    const = OptimConfig(schedule="constant", warmup_steps=w, warmup_min_ratio=0.2)
    assert lr_factor(0, const, t) == pytest.approx(0.2 + 0.8 / w) and lr_factor(w - 1, const, t) == 1.0
    assert {lr_factor(k, const, t) for k in range(w, 3 * t)} == {1.0}
    wsd = OptimConfig(schedule="wsd", warmup_steps=w, min_lr_ratio=r, decay_fraction=0.25)  # D = 5 steps
    assert [lr_factor(k, wsd, t) for k in range(w, 15)] == [1.0] * (15 - w)
    for k in range(15, t):
        assert lr_factor(k, wsd, t) == pytest.approx(r + (1 - r) * (t - 1 - k) / 5)
    assert lr_factor(t - 1, wsd, t) == pytest.approx(r) and lr_factor(t + 3, wsd, t) == pytest.approx(r)


def test_total_steps_sets_the_span_and_log_warmup_reaches_one():
    cfg = OptimConfig(schedule="linear", warmup_steps=2, min_lr_ratio=0.0, total_steps=10)
    assert lr_factor(9, cfg, 1000) == 0.0 and lr_factor(5, cfg, 1000) == pytest.approx(4 / 8)
    log = OptimConfig(schedule="constant", warmup_steps=8, warmup_type="log")
    fractions = [lr_factor(k, log, 50) for k in range(8)]
    assert fractions == sorted(fractions) and fractions[0] == pytest.approx(math.log(2) / math.log(8))
    assert fractions[6] == fractions[7] == 1.0  # ln(8)/ln(8) at k = 6, capped after


def optimizer(lr):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def deepspeed_lrs(make, steps):
    """The lr a DeepSpeed scheduler holds at last_batch_iteration = k + 1, for k in range(steps)."""
    sched = make()
    lrs = []
    for k in range(steps):
        sched.step(k + 1)
        lrs.append(sched.get_lr()[0])
    return lrs


def tessera_lrs(cfg, steps, run_steps):
    opt = optimizer(cfg.lr)
    sched = build_scheduler(opt, cfg, run_steps)
    lrs = []
    for _ in range(steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_constant_is_deepspeeds_warmup_lr(warmup_type, deepspeed_cpu):
    WarmupLR = pytest.importorskip("deepspeed.runtime.lr_schedules").WarmupLR
    want = deepspeed_lrs(lambda: WarmupLR(optimizer(0.0), warmup_min_lr=1e-4, warmup_max_lr=3e-3,
                                          warmup_num_steps=10, warmup_type=warmup_type), 25)
    cfg = OptimConfig(lr=3e-3, schedule="constant", warmup_steps=10, warmup_type=warmup_type,
                      warmup_min_ratio=1e-4 / 3e-3)
    assert tessera_lrs(cfg, 25, 1000) == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_linear_is_deepspeeds_warmup_decay_lr(warmup_type, deepspeed_cpu):
    WarmupDecayLR = pytest.importorskip("deepspeed.runtime.lr_schedules").WarmupDecayLR
    want = deepspeed_lrs(lambda: WarmupDecayLR(optimizer(0.0), total_num_steps=30, warmup_min_lr=0.0,
                                               warmup_max_lr=1e-3, warmup_num_steps=6,
                                               warmup_type=warmup_type), 36)
    cfg = OptimConfig(lr=1e-3, schedule="linear", warmup_steps=6, warmup_type=warmup_type, min_lr_ratio=0.0,
                      total_steps=30)
    assert tessera_lrs(cfg, 36, 1000) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert want[-1] == 0.0  # past total_num_steps both stay at the floor


def test_cosine_lies_within_deepspeeds_warmup_cosine_lr(deepspeed_cpu):
    """WarmupCosineLR's warm-up up to step W - 2; tessera's cosine then holds the peak at steps W - 1 and W,
    where DeepSpeed's has begun to decay, and from step W + 1 lies between DeepSpeed's values one iteration
    before and one after, reaching the same floor at step T - 1."""
    WarmupCosineLR = pytest.importorskip("deepspeed.runtime.lr_schedules").WarmupCosineLR
    w, t = 5, 40
    sched = WarmupCosineLR(optimizer(2e-3), total_num_steps=t, warmup_min_ratio=0.1, warmup_num_steps=w,
                           cos_min_ratio=0.05, warmup_type="linear")
    ds = {}
    for it in range(0, t + 3):
        sched.step(it)
        ds[it] = sched.get_lr()[0]
    cfg = OptimConfig(lr=2e-3, schedule="cosine", warmup_steps=w, warmup_min_ratio=0.1, min_lr_ratio=0.05,
                      total_steps=t)
    ours = tessera_lrs(cfg, t + 1, 1000)
    assert ours[:w - 1] == pytest.approx([ds[k + 1] for k in range(w - 1)], rel=1e-12)
    assert ours[w - 1] == ours[w] == 2e-3 > ds[w] > ds[w + 1]  # the peak held where DeepSpeed's decays
    for k in range(w + 1, t):
        assert ds[k + 1] - 1e-15 <= ours[k] <= ds[k - 1] + 1e-15, k
    assert ours[t - 1] == pytest.approx(ds[t], rel=1e-12) == pytest.approx(2e-3 * 0.05)


@pytest.mark.parametrize("override,match", [
    ({"schedule": "exponential"}, "optim.schedule='exponential' is unknown"),
    ({"warmup_type": "cubic"}, "optim.warmup_type='cubic' is unknown"),
    ({"warmup_type": "log", "warmup_steps": 1}, "needs optim.warmup_steps >= 2"),
    ({"decay_fraction": 0.0}, r"decay_fraction must be in \(0, 1\]"),
    ({"decay_fraction": 1.5}, r"decay_fraction must be in \(0, 1\]"),
    ({"total_steps": -1}, "optim.total_steps must be 0"),
    ({"warmup_min_ratio": 1.5}, r"warmup_min_ratio must be in \[0, 1\]"),
])
def test_bad_schedule_settings_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        OptimConfig(**override).validate()


# DeepSpeed's scheduler sections as its config documentation writes them, and variants: log and linear
# warm-ups, warmup_min_lr > 0, warmup_num_steps 1 (raised to 2 by both), a span shorter than the warm-up
DEEPSPEED_SCHEDULERS = [
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}}, 1010),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 7,
                                     "warmup_type": "linear"}}, 12),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 1}}, 5),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                          "warmup_num_steps": 10}}, 110),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_min_lr": 2e-5, "warmup_max_lr": 4e-4,
                                          "warmup_num_steps": 6, "warmup_type": "linear"}}, 40),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_min_ratio": 0, "warmup_num_steps": 10,
                                           "cos_min_ratio": 0.0001}}, 110),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 40, "warmup_min_ratio": 0.1, "warmup_num_steps": 5,
                                           "cos_min_ratio": 0.05, "warmup_type": "linear"}}, 50),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 3, "warmup_num_steps": 1}}, 8),
]


def engine_lrs(scheduler, opt, steps):
    """The lr DeepSpeed's engine runs optimizer steps 0..steps-1 at: the optimizer's lr, the scheduler
    stepped after each applied step and never before the first (runtime/engine.py _take_model_step)."""
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        scheduler.step()
    return lrs


@pytest.mark.parametrize("scheduler, steps", DEEPSPEED_SCHEDULERS)
def test_deepspeed_mapping_gives_deepspeeds_lr_at_every_step(scheduler, steps, deepspeed_cpu):
    """``tessera train --deepspeed``'s schedule against DeepSpeed's scheduler object, built as its engine
    builds it (``getattr(lr_schedules, type)(optimizer, **params)``) over the optimizer's lr."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from tessera.train.config import load_config
    from tessera.train.deepspeed_json import read_deepspeed

    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "scheduler": scheduler}
    opt = optimizer(2e-3)
    want = engine_lrs(getattr(lr_schedules, scheduler["type"])(opt, **scheduler["params"]), opt, steps)
    cfg = load_config(None, read_deepspeed(ds).overrides).optim
    ours = tessera_lrs(cfg, steps, 10_000)
    if scheduler["params"].get("warmup_min_lr", 0) == 0:  # DeepSpeed's expressions, bit for bit
        assert ours == want
    else:  # DeepSpeed adds warmup_min_lr + Δ·γ, tessera multiplies the peak by a ratio: an ulp apart
        assert ours == pytest.approx(want, rel=1e-14, abs=0)
    assert len(set(want)) >= 2  # the sequence moves (a warm-up at least)


def test_deepspeed_schedules_refuse_fewer_than_two_warmup_steps():
    with pytest.raises(ConfigError, match="needs optim.warmup_steps >= 2"):
        OptimConfig(schedule="deepspeed-warmup-cosine", warmup_steps=1, total_steps=10).validate()
