"""Seeing into a run: TensorBoard event files, profiler traces of chosen steps, model FLOP/s and MFU, each
step's time split, and ``tessera report`` (one self-contained HTML page of a run folder)."""
