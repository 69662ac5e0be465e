"""Measured bubble and peak activations on 4 gloo ranks with equal, fixed stage times (TimedStage)."""

import pytest

from tessera.pipeline.measure import measure_bubble
from tessera.topology import ParallelConfig, Topology

P = 4


def bubble_worker(rank, world_size, cases):
    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=60))
    try:
        out = {}
        for name, m, v in cases:
            r = measure_bubble(topo.group("pp"), name, m, v, forward_s=0.03, steps=2)
            out[(name, m, v)] = {"bubble": r["bubble"], "peak": r["peak"]}
        return out
    finally:
        topo.destroy()


def test_measured_bubble_matches_theory_and_orders_schedules(rank_pool):
    cases = [(s, m, 1) for s in ("gpipe", "1f1b") for m in (4, 8, 16)]
    cases += [("interleaved", m, 2) for m in (4, 8)] + [("zb-h1", m, 1) for m in (4, 8)]
    res = rank_pool.run(bubble_worker, P, cases=cases, timeout=300)
    measured = res[0]
    for name in ("gpipe", "1f1b"):
        for m in (4, 8, 16):
            assert measured[(name, m, 1)]["bubble"] == pytest.approx((P - 1) / (m + P - 1), abs=0.05), (name, m)
    for m in (4, 8):
        assert measured[("interleaved", m, 2)]["bubble"] < measured[("1f1b", m, 1)]["bubble"]
        assert measured[("zb-h1", m, 1)]["bubble"] < measured[("1f1b", m, 1)]["bubble"]
        # B and W one forward each: Qi et al.'s (p-1)(F+B-W) idle against m(F+B+W) of work
        assert measured[("zb-h1", m, 1)]["bubble"] == pytest.approx((P - 1) / (3 * m + P - 1), abs=0.05), m
    for m in (4, 8, 16):
        # GPipe holds every micro-batch's activations on every rank; 1F1B at most P.
        assert [r[("gpipe", m, 1)]["peak"] for r in res] == [m] * P
        assert max(r[("1f1b", m, 1)]["peak"] for r in res) <= P
