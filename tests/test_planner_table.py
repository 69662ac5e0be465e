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
