"""The calibration's single-thread pieces are timed in the same rounds, and the non-matmul rate is taken
within each round: a machine whose speed changes between pieces no longer sets it."""

import pytest

from tessera.planner.calibrate import elementwise_from_rounds, elementwise_seconds_per_byte
from tessera.planner.reference_step import rates, timed_rounds

# one consistent machine: the reference step at 2.5e10 FLOP/s, its layer matmuls at 4e10, attention at 3e10
BASE = {"step_flops_alone": 2.5e10, "peak_flops": 4e10, "hbm_bytes_per_s": 1e10, "layer_call_s": 2e-3,
        "attention_rate": 3e10, "attention_row_s": 3e-7}
SECONDS = ("layer_call_s", "attention_row_s")
RING = ("ring_forward_s", "ring_backward_s")  # per score beyond the FLOPs: may be 0 on a fast-matmul machine


def _args(r):
    return (r["step_flops_alone"], r["peak_flops"], r["hbm_bytes_per_s"], r["layer_call_s"], r["attention_rate"],
            r["attention_row_s"])


def at_speed(k: float, **only) -> dict:
    """BASE on a machine k times as fast (rates × k, seconds ÷ k); ``only``: other factors for some pieces."""
    factors = {name: only.get(name, k) for name in BASE}
    return {name: value / factors[name] if name in SECONDS else value * factors[name]
            for name, value in BASE.items()}


def test_pieces_run_in_turn_round_after_round_and_the_first_round_only_warms_up():
    order = []
    times = timed_rounds({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 0.0, min_rounds=4)
    assert order == ["a", "b"] * 4
    assert [len(t) for t in times.values()] == [3, 3] and all(x >= 0 for t in times.values() for x in t)
    once = timed_rounds({"a": lambda: None}, 0.0)  # one round asked for: it counts
    assert len(once["a"]) == 1


def test_the_rest_is_taken_within_each_round_at_that_rounds_speed():
    want = elementwise_seconds_per_byte(*_args(BASE))
    assert want > 0
    # the whole machine at three speeds: every round gives the same share, so the same rate per byte
    fastest = at_speed(1.0)
    assert elementwise_from_rounds(fastest, [at_speed(1.0), at_speed(0.7), at_speed(0.85)]) == pytest.approx(want)
    # the matmuls timed in a slow spell and the step at full speed, each in its own window as the
    # calibration used to: the difference loses most of the rest (here all of it) ...
    slow_matmuls = at_speed(1.0, peak_flops=0.6)
    assert elementwise_seconds_per_byte(*_args(slow_matmuls)) < want / 2
    # ... while a slow spell in one round of three does not move the median share
    assert elementwise_from_rounds(fastest, [at_speed(1.0), slow_matmuls, at_speed(0.9)]) == pytest.approx(want)


def test_rates_of_the_reference_step_are_measured_together():
    at_one_speed, per_round = rates(seconds=0.0, min_rounds=2)
    assert len(per_round) == 1
    for r in (at_one_speed, *per_round):
        assert set(r) == set(BASE) | set(RING)
        assert all(v > 0 for k, v in r.items() if k not in SECONDS + RING)
        assert all(r[k] >= 0 for k in SECONDS + RING)
        # a training step runs more than its matmuls: below the matmul rate
        assert r["step_flops_alone"] < r["peak_flops"]
