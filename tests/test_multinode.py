"""Two machines, played by two torchrun agents on this one over loopback: a c10d rendezvous at one
agent's address, one rank per agent; the job trains like a 2-rank job on one machine."""

from __future__ import annotations

import json
import os
import socket
import uuid

import pytest

from test_elastic import Lines, job_args, reference, stop, torchrun, train_losses  # noqa: F401 (reference: a fixture)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_agents_with_a_c10d_rendezvous_train_like_one_machine(tmp_path, corpus_cache, reference):
    ref_summary, ref_run = reference
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    # the same command on both "nodes"; no --node-rank: the rendezvous numbers the agents. Each "node"
    # gets one core of its own, so its rank runs one thread like the reference's pool rank on any machine
    # (the loss comparison must not depend on how many cores the machine has).
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    halves = [{cores[0]}, {cores[1]}] if len(cores) >= 2 else [None, None]
    agents = [torchrun(1, job_args(tmp_path, corpus_cache, "nodes"), nnodes=2, endpoint=endpoint,
                       run_id=run_id, max_restarts=0, cores=half) for half in halves]
    outputs = [(Lines(a.stdout), Lines(a.stderr)) for a in agents]
    try:
        for agent in agents:
            agent.wait(timeout=200)
    finally:
        for agent in agents:
            stop(agent)
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err.text()[-3000:]
    # rank 0 (on whichever agent the rendezvous made node 0) prints the report
    reports = [out.text() for out, _ in outputs]
    assert sum("val_loss_end" in r for r in reports) == 1
    summary = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    assert summary["layout"].startswith("2 rank(s): dp_replicate=2")
    assert summary["val_loss_end"] == pytest.approx(ref_summary["val_loss_end"], rel=1e-5)
    got, ref = train_losses(tmp_path / "nodes"), train_losses(ref_run)
    assert sorted(got) == sorted(ref)
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-5), step
    # each agent's rank wrote its own part of the final checkpoint
    final = tmp_path / "nodes" / "checkpoint" / "step_000030"
    assert (final / "__0_0.distcp").exists() and (final / "__1_0.distcp").exists()
