"""benchmarks/_planner_table.py: the shapes used in development are summarized apart from the held-out
ones, and only held-out rows are checked against the targets."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _planner_table  # noqa: E402


def _row(shape: str, step_pred: float) -> dict:
    return {"shape": shape, "config": "ddp", "step_pred": step_pred, "step_meas": 1.0,
            "states_pred": 1.0, "states_meas": 1.0, "acts_pred": 1.0, "acts_meas": 1.0}


def test_development_shapes_stay_out_of_the_held_out_summary():
    rows = [_row("cal", 1.0), _row("deep", 2.0), _row("long", 1.1)]
    text = _planner_table.summary(rows, "cal", ("deep",))
    assert "- shapes used in development (1 rows): |step error| median 100.0%" in text
    assert "- held-out shapes (1 rows): |step error| median 10.0%, largest 10.0%" in text
    assert text.endswith("outside the targets (step within 30%, memory within 5%): none.")  # deep's miss not counted
    assert "deep/ddp" in _planner_table.summary(rows, "cal")  # without the label it would be held out


def test_the_summary_at_host_speed_uses_the_rescaled_predictions():
    rows = [{**_row("cal", 0.6), "step_pred_at_speed": 0.95}, {**_row("long", 0.5), "step_pred_at_speed": 1.2}]
    raw = _planner_table.summary(rows, "cal")
    assert "long/ddp (step -50.0%" in raw
    fast = _planner_table.summary(rows, "cal", at_speed=True)
    assert "- calibration shape (1 rows): |step error| median 5.0%" in fast
    assert "- held-out shapes (1 rows): |step error| median 20.0%" in fast and fast.endswith("none.")


def test_the_host_speed_probe_times_the_reference_step_and_rescales_compute_only():
    import _host_speed

    cal = {"step_flops_alone": 1e30, "peak_flops": 4e10, "attention_rate": 2e10, "hbm_bytes_per_s": 1e10,
           "elementwise_s_per_byte": 1e-9, "layer_call_s": 2e-3, "alpha_s": 1e-4, "bytes_per_s": 1e9,
           "collective_sync_s": 1e-3, "half_flops": 0.0}
    speed = _host_speed.probe(cal, passes=1)
    assert 0 < speed < 1e-15  # a real step against an impossible calibrated rate
    slow = _host_speed.at_speed(cal, 0.5)
    assert slow["peak_flops"] == 2e10 and slow["attention_rate"] == 1e10 and slow["hbm_bytes_per_s"] == 5e9
    assert slow["elementwise_s_per_byte"] == 2e-9 and slow["layer_call_s"] == 4e-3
    assert all(slow[k] == cal[k] for k in ("alpha_s", "bytes_per_s", "collective_sync_s", "half_flops"))
