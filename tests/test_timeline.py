"""The Timeline instrument: spans, bubble fraction, Chrome trace and Gantt PNG (pure, no process group)."""

import json
import time

import pytest

from tessera.timeline import Event, Timeline, bubble_fraction, chrome_trace, write_chrome_trace, write_gantt_png


def events():
    # rank 0 computes [0,1] and [2,3]; rank 1 [1,2] and [3,4] plus an overlapping span counted once.
    return [Event("F0.0", "compute", 0, 0.0, 1.0), Event("B0.0", "compute", 0, 2.0, 3.0),
            Event("F1.0", "compute", 1, 1.0, 2.0), Event("B1.0", "compute", 1, 3.0, 4.0),
            Event("W1.0", "compute", 1, 3.5, 4.0), Event("wait F1.0", "comm", 1, 0.0, 1.0)]


def test_bubble_fraction_counts_idle_time_per_rank():
    overall, per_rank = bubble_fraction(events())
    assert per_rank == pytest.approx([0.5, 0.5]) and overall == pytest.approx(0.5)
    overall, per_rank = bubble_fraction(events(), window=(0.0, 2.0))
    assert per_rank == pytest.approx([0.5, 0.5])
    assert bubble_fraction(events(), cat="comm")[1] == pytest.approx([1.0, 0.0])  # rank 0 has no comm span


def test_span_records_start_and_end_and_can_be_disabled():
    tl = Timeline(rank=3)
    with tl.span("F0.1"):
        time.sleep(0.01)
    (e,) = tl.events
    assert e.rank == 3 and e.cat == "compute" and e.end - e.start >= 0.009
    off = Timeline(enabled=False)
    with off.span("x"):
        pass
    off.add("y", "comm", 0.0, 1.0)
    assert off.events == []


def test_chrome_trace_and_png(tmp_path):
    trace = chrome_trace(events())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 6 and {e["tid"] for e in spans} == {0, 1}
    b = next(e for e in spans if e["name"] == "B1.0")
    assert b["ts"] == pytest.approx(3e6) and b["dur"] == pytest.approx(1e6)
    path = tmp_path / "trace.json"
    write_chrome_trace(str(path), events())
    assert json.loads(path.read_text())["traceEvents"]
    png = tmp_path / "timeline.png"
    write_gantt_png(str(png), events(), title="gpipe", bubble=0.5)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
