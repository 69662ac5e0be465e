"""fp16 loss-scale hysteresis and floor (precision.hysteresis, precision.min_loss_scale): the scaler's
sequence of scales against DeepSpeed's DynamicLossScaler on fixed overflow patterns, the count through
state_dict, and the settings' checks."""

import types

import pytest

from tessera.errors import ConfigError
from tessera.precision import LossScaler, PrecisionConfig

# 1 = overflow. Long runs of overflows (down to the floor and beyond), isolated ones, and clean stretches
# shorter than the growth window: only overflows and hysteresis move the scale.
PATTERN = [1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1]


def deepspeed_scales(pattern, init, window, floor, hysteresis, monkeypatch, consecutive=False):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))  # its log line's rank
    ds = loss_scaler.DynamicLossScaler(init_scale=init, scale_window=window, min_scale=floor,
                                       delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                                       raise_error_at_min_scale=False)
    out = []
    for overflow in pattern:
        ds.update_scale(bool(overflow))
        out.append(ds.cur_scale)
    return out


def tessera_scales(pattern, scaler):
    out = []
    for overflow in pattern:
        applied = scaler.update(not overflow)
        assert applied == (not overflow)  # every overflow skips its step, whatever the hysteresis
        out.append(scaler.scale)
    return out


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_scales_match_deepspeeds_dynamic_loss_scaler(hysteresis, monkeypatch, deepspeed_cpu):
    want = deepspeed_scales(PATTERN, 2.0 ** 10, 1000, 8.0, hysteresis, monkeypatch)
    cfg = PrecisionConfig(dtype="fp16", init_scale=2.0 ** 10, growth_interval=1000, hysteresis=hysteresis,
                          min_loss_scale=8.0).validate()
    scaler = LossScaler.from_config(cfg)
    assert tessera_scales(PATTERN, scaler) == want
    assert min(want) == 8.0 and scaler.skipped == sum(PATTERN)


def test_growth_refills_the_hysteresis():
    """DeepSpeed's default (consecutive_hysteresis=false): clean steps do not refill the allowance, a growth
    of the scale does. (DeepSpeed grows one clean step later than torch's GradScaler rule kept here, so this
    part is checked against the closed form.)"""
    s = LossScaler(scale=64.0, growth_interval=2, hysteresis=2)
    seq = tessera_scales([1, 0, 1, 0, 0, 1, 1], s)
    # overflow: allowance 2 → 1; clean; overflow: halves (32); clean, clean: grows (64), allowance back to 2;
    # overflow: 2 → 1 (no halving); overflow: halves (32)
    assert seq == [64.0, 64.0, 32.0, 32.0, 64.0, 64.0, 32.0]


def test_hysteresis_count_survives_state_dict():
    a = LossScaler(scale=256.0, hysteresis=3)
    tessera_scales([1, 1], a)
    b = LossScaler(scale=1.0, hysteresis=3)
    for key, value in a.state_dict().items():  # what the trainer does on resume (meta["loss_scaler"])
        setattr(b, key, value)
    assert b.overflows_left == 1 and tessera_scales([1], b) == [128.0]
    old = {"scale": 512.0, "clean_steps": 3, "skipped": 2}  # a checkpoint written before hysteresis existed
    c = LossScaler(scale=1.0, hysteresis=2)
    for key, value in old.items():
        setattr(c, key, value)
    assert tessera_scales([1, 1], c) == [512.0, 256.0]


def test_default_halves_at_every_overflow_down_to_one():
    s = LossScaler.from_config(PrecisionConfig(dtype="fp16", init_scale=4.0))
    assert (s.hysteresis, s.min_scale) == (1, 1.0)
    assert tessera_scales([1, 1, 1, 1], s) == [2.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("override,match", [
    ({"hysteresis": 0}, "precision.hysteresis must be at least 1"),
    ({"min_loss_scale": 0.0}, "precision.min_loss_scale must be positive"),
    ({"min_loss_scale": 2.0 ** 20}, "at most precision.init_scale=65536"),
])
def test_bad_settings_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        PrecisionConfig(dtype="fp16", **override).validate()


# clean stretches longer than the window after the start and after overflows: the growth timing shows
GROWTH_PATTERN = [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 0, 0, 0,
                  0, 1, 1, 0, 0]


def mapped_scaler(fp16: dict, stage: int):
    """The scaler ``tessera train --deepspeed`` builds for a DeepSpeed config's fp16 section at ZeRO ``stage``."""
    from tessera.train.config import load_config
    from tessera.train.deepspeed_json import read_deepspeed

    job = read_deepspeed({"fp16": {"enabled": True, **fp16}, "zero_optimization": {"stage": stage}})
    return LossScaler.from_config(load_config(None, job.overrides).precision.validate())


@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("hysteresis, consecutive", [(1, False), (2, False), (2, True), (3, True)])
def test_deepspeed_mapping_gives_zero_scalers_scales(window, hysteresis, consecutive, monkeypatch, deepspeed_cpu):
    """Under ZeRO, DeepSpeed's DynamicLossScaler (its window counted from the last overflow or the start,
    consecutive_hysteresis either way) against the mapped scaler, step for step."""
    want = deepspeed_scales(GROWTH_PATTERN, 2.0 ** 8, window, 4.0, hysteresis, monkeypatch, consecutive)
    fp16 = {"initial_scale_power": 8, "loss_scale_window": window, "min_loss_scale": 4, "hysteresis": hysteresis,
            "consecutive_hysteresis": consecutive}
    assert tessera_scales(GROWTH_PATTERN, mapped_scaler(fp16, stage=2)) == want
    assert max(want) > 2.0 ** 8  # the scale grew


def test_deepspeed_mapping_without_zero_halves_at_every_overflow(deepspeed_cpu):
    """Without ZeRO, DeepSpeed's FP16 optimizers keep their own scale (``_update_scale``: no hysteresis)."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    args = {"init_scale": 2.0 ** 8, "scale_window": 2, "delayed_shift": 3, "consecutive_hysteresis": False,
            "min_scale": 4.0}
    fake = types.SimpleNamespace(verbose=False, loss_scale_config=LossScaleConfig(
        low_precision_dtype=torch.float16, dynamic_loss_scale=True, static_loss_scale=1.0, dynamic_loss_args=args))
    want = []
    for overflow in GROWTH_PATTERN:
        FP16_UnfusedOptimizer._update_scale(fake, bool(overflow))
        want.append(fake.loss_scale_config.cur_scale)
    scaler = mapped_scaler({"initial_scale_power": 8, "loss_scale_window": 2, "min_loss_scale": 4, "hysteresis": 3},
                           stage=0)
    assert scaler.hysteresis == 1 and tessera_scales(GROWTH_PATTERN, scaler) == want


def test_consecutive_hysteresis_and_growth_delay():
    """consecutive: a clean step refills the allowance; growth_delay: the first growth after an overflow
    waits one clean step more, the next ones do not."""
    s = LossScaler(scale=64.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=True)
    assert tessera_scales([1, 0, 1, 0, 1, 1], s) == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0]
    s = LossScaler(scale=64.0, growth_interval=2, growth_delay=1)
    assert tessera_scales([0, 0, 0, 0, 0, 1, 0, 0, 0], s) == [64.0, 64.0, 128.0, 128.0, 256.0, 128.0, 128.0, 128.0,
                                                              256.0]
