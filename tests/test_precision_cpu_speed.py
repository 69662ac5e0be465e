"""The launch-time warning for half precision on a CPU without instructions for it (tessera.precision.cpu_speed)."""

import pytest
import torch

from tessera.cli import main
from tessera.precision import cpu_speed


def test_the_slowdown_is_measured_on_this_cpu():
    slowdown = cpu_speed.half_matmul_slowdown(torch.bfloat16, n=64)
    assert slowdown > 0 and slowdown == slowdown  # a real ratio of two timings (not NaN)


@pytest.mark.parametrize("slowdown, warned", [(20.0, True), (1.5, False)])
def test_a_slow_half_precision_product_is_named_with_its_ratio(monkeypatch, slowdown, warned):
    monkeypatch.setattr(cpu_speed, "half_matmul_slowdown", lambda dtype, n=256: slowdown)
    note = cpu_speed.slow_half_precision_note("cpu", "bf16")
    if warned:
        assert note.startswith("tessera: warning: a bf16 matrix product takes 20× as long as an fp32 one")
        assert note.endswith("--precision.dtype=fp32")
    else:
        assert note is None


def test_fp32_and_accelerator_jobs_measure_nothing(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("measured a product it did not need")

    monkeypatch.setattr(cpu_speed, "half_matmul_slowdown", refuse)
    assert cpu_speed.slow_half_precision_note("cpu", "fp32") is None
    assert cpu_speed.slow_half_precision_note("cuda", "bf16") is None


def test_tessera_train_prints_the_warning_before_launch(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cpu_speed, "half_matmul_slowdown", lambda dtype, n=256: 13.0)
    code = main(["train", "--dry-run", "--nproc", "1", "--model.preset=tiny", "--precision.dtype=bf16",
                 f"--run.out_dir={tmp_path}"])
    assert code == 0
    err = capsys.readouterr().err
    assert "a bf16 matrix product takes 13× as long as an fp32 one" in err
