"""How fast this machine runs at a given moment, against its calibration.

A shared CPU host changes speed by tens of percent over minutes (here the reference step ran at 38 to 54
GFLOP/s within one validation run), while the planner's calibration is a snapshot of about twenty seconds.
Before each row, benchmarks/planner_validation.py times the calibration's own reference step again
(never the row's shape: the shapes stay held out) and records the ratio, so that its table tells the
model's error apart from the machine's drift: each row also gets the prediction with the calibration's
compute rates scaled to the speed of the moment.
"""

from __future__ import annotations

from tessera.planner.reference_step import REFERENCE, fastest, one_thread, training_step

RATES = ("peak_flops", "half_flops", "step_flops", "step_flops_alone", "attention_rate", "hbm_bytes_per_s")
SECONDS = ("elementwise_s_per_byte", "layer_call_s")  # per-byte and per-call costs: ÷ speed


def probe(calibration: dict, passes: int = 3) -> float:
    """The reference step's FLOP/s now (fastest of ``passes`` after a warm-up, one thread, CPU time) over
    the calibration's ``step_flops_alone``: 1.0 when the machine runs as fast as when it was calibrated."""
    with one_thread():
        run, flops = training_step(*REFERENCE)
        best = fastest({"step": run}, 0.0, passes + 1)["step"]
    return flops / best / calibration["step_flops_alone"]


def at_speed(calibration: dict, speed: float) -> dict:
    """The calibration with its compute rates × ``speed`` and its compute seconds ÷ ``speed``; the
    collectives' α, β and start-up as measured (gloo's loopback, timed apart)."""
    out = dict(calibration)
    for key in RATES:
        if out.get(key):
            out[key] = out[key] * speed
    for key in SECONDS:
        if out.get(key):
            out[key] = out[key] / speed
    return out
