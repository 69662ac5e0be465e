"""The [zero], [precision] and [checkpointing] sections and parallel.zero_stage: bad values and
combinations that cannot work end in one ConfigError sentence before any rank starts."""

import pytest
import torch

from tessera.errors import ConfigError
from tessera.precision import PrecisionConfig
from tessera.train.config import load_config, validate_config
from tessera.zero import ZeroConfig


def test_sections_and_stage_load_from_overrides():
    cfg = load_config(None, ["--parallel.zero_stage=3", "--precision.dtype=bf16", "--checkpointing.mode=selective",
                             "--zero.offload=true", "--checkpointing.every=2"])
    validate_config(cfg, 2)
    assert (cfg.parallel.zero_stage, cfg.precision.dtype, cfg.checkpointing.mode) == (3, "bf16", "selective")
    assert cfg.zero.offload and cfg.checkpointing.every == 2
    assert cfg.precision.param_dtype == torch.bfloat16 and cfg.precision.grad_reduce_dtype == torch.bfloat16
    assert PrecisionConfig(dtype="bf16", reduce_dtype="fp32").grad_reduce_dtype == torch.float32


@pytest.mark.parametrize("overrides,message", [
    (["--parallel.zero_stage=4"], "parallel.zero_stage must be 0, 1, 2 or 3, got 4"),
    (["--zero.offload=true"], "zero.offload moves the sharded optimizer to the host, so it needs "
                              "parallel.zero_stage of 1, 2 or 3"),
    (["--parallel.zero_stage=2", "--ddp.find_unused_parameters=true"],
     "ddp.find_unused_parameters=True has no effect in this job: it applies only when DDP reduces"),
    (["--precision.loss_scale=dynamic"], "precision.loss_scale=dynamic protects fp16 gradients"),
    (["--precision.dtype=fp8"], "precision.dtype must be one of fp32, bf16, fp16, got 'fp8'"),
    (["--precision.loss_scale=-3"], "precision.loss_scale must be"),
    (["--checkpointing.mode=some"], "checkpointing.mode must be one of none, full, selective"),
    (["--zero.wrap_policy=layer"], "zero.wrap_policy must be one of block, size, manual"),
])
def test_impossible_settings_are_one_sentence(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(None, overrides), 2)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_zero_defaults_validate():
    assert ZeroConfig().validate() and PrecisionConfig().validate()
