"""Fault tolerance: a peer that is gone gives a one-sentence error naming rank, op and axis; a rank killed
mid-training under torchrun's elastic agent is restarted and the job resumes from its newest checkpoint
with the loss of an undisturbed run; a restart with a different number of ranks reshards."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from tessera import comm
from tessera.comm import CommGroup, CommLedger, P2POp
from tessera.comm.collectives import comm_failure
from tessera.errors import CommError, CommTimeoutError, PeerGoneError
from tessera.launch import run_rank
from tessera.train.config import load_config
from tessera.train.resume import read_progress


# ---- a peer that is gone (on the rank pool: rank 1 destroys a subgroup while rank 0 still uses it,
# which closes gloo's connections just as a dying process does, and leaves the pool healthy) ----

def peer_gone_worker(rank, world_size, op):
    pg = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    g = CommGroup("pp" if op != "all_reduce" else "dp", pg, (0, 1), rank, CommLedger(), timedelta(seconds=30))
    comm.all_reduce(torch.ones(2), g)  # call #1 completes on both ranks
    result = None
    if rank == 1:  # leave: every connection of the group closes, as if this process had died
        dist.destroy_process_group(pg)
        g.pg = pg = None
        gc.collect()
    else:
        start = time.monotonic()
        try:
            if op == "all_reduce":
                comm.all_reduce(torch.ones(2), g)
            elif op == "recv":
                comm.recv(torch.zeros(2), g, src=1)
            else:  # a pipeline stage's batched exchange, waited on through its handles
                for h in comm.batch_isend_irecv([P2POp("send", torch.ones(2), 1), P2POp("recv", torch.zeros(2), 1)], g):
                    h.wait()
        except CommError as err:
            result = {"type": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start,
                      "rank": err.rank, "op": err.op, "axis": err.axis, "peer": err.peer, "cause": err.cause}
        dist.destroy_process_group(pg)
    dist.barrier()  # the default group stays healthy
    return result


@pytest.mark.multirank
@pytest.mark.parametrize("op", ["all_reduce", "recv", "batch"])
def test_a_peer_that_is_gone_is_named_at_once_not_reported_as_a_timeout(rank_pool, op):
    result = rank_pool.run(peer_gone_worker, 2, timeout=60, op=op)[0]
    assert result is not None, "rank 0's call completed although its peer was gone"
    assert result["type"] == PeerGoneError.__name__ and result["cause"] == "peer gone"
    assert result["seconds"] < 10  # the 30 s timeout did not have to run out
    message = result["message"]
    axis, name = ("dp", "all_reduce") if op == "all_reduce" else ("pp", "recv" if op == "recv" else "")
    assert message.startswith(f"rank 0: {name}") and f"on axis '{axis}' (ranks [0, 1])" in message
    assert "failed because peer rank 1 is gone" in message and "did not complete within" not in message
    assert "backend said: " in message and "\n" not in message and "GLHF" not in message
    assert (result["rank"], result["axis"], result["peer"]) == (0, axis, 1)


@pytest.mark.parametrize("said, kind, words", [
    ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4711. This is typically caused "
     "by a remote worker crashing.", PeerGoneError, "failed because peer rank 3 is gone"),
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1500ms for recv operation to complete",
     CommTimeoutError, "did not complete within 90 s: peer rank 3 hung or issued a different collective"),
    ("Tensors must be contiguous", CommError, "failed (recent calls on this axis: none; backend said: "
     "Tensors must be contiguous)"),
])
def test_the_message_follows_the_cause(said, kind, words):
    group = CommGroup("tp", None, (2, 3), 2, CommLedger(), timedelta(seconds=90))
    err = comm_failure(group, "all_gather", 7, RuntimeError(said))
    assert type(err) is kind and (err.rank, err.op, err.axis, err.ranks, err.peer) == (2, "all_gather", "tp", (2, 3), 3)
    assert str(err).startswith("rank 2: all_gather call #7 on axis 'tp' (ranks [2, 3]) ") and words in str(err)
    assert "\n" not in str(err) and "pair.cc" not in str(err) and "typically" not in str(err)
    # in a larger group the peer is not known: "a peer"
    wide = CommGroup("dp", None, (0, 1, 2), 0, CommLedger())
    assert comm_failure(wide, "all_reduce", 1, RuntimeError(said)).peer is None


def test_a_rank_whose_peer_is_gone_says_one_sentence_and_exits_1_for_the_agent(monkeypatch, capsys):
    from tessera import launch

    gone = PeerGoneError("rank 0: all_reduce call #37 on axis 'dp' (ranks [0, 1]) failed because peer rank 1 "
                         "is gone: its process crashed, was killed or exited (backend said: Connection reset)")

    def fail(cfg):
        raise gone

    monkeypatch.setattr(launch, "run_rank", fail)
    with pytest.raises(SystemExit) as info:
        launch.rank_entry(None)
    assert info.value.code == 1  # not 2: the job failed, not the user; torchrun restarts on it
    assert capsys.readouterr().err.splitlines() == [f"tessera: error: {gone}"]


# ---- kill -9 of one rank under torchrun: restart, resume, same loss ----

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY = 30, 5


def job_args(out_dir, cache, name, extra=()):
    """A tiny run of STEPS steps that checkpoints every EVERY steps and, restarted, resumes by itself."""
    return ["--model.preset=tiny", f"--train.steps={STEPS}", "--train.log_every=1", "--train.eval_every=10",
            "--data.seq_len=32", "--data.global_batch_size=8", "--data.micro_batch_size=2",
            "--data.eval_batches=2", f"--data.cache_dir={cache}", f"--run.out_dir={out_dir}",
            "--run.progress=false", "--optim.warmup_steps=2", f"--run.name={name}",
            f"--checkpoint.every={EVERY}", "--checkpoint.keep=10", "--checkpoint.resume=auto", *extra]


def torchrun(nproc: int, args: list[str], *, nnodes: int = 1, endpoint: str = "localhost:0",
             run_id: str | None = None, max_restarts: int = 1, monitor_interval: float = 0.1,
             cores: set[int] | None = None) -> subprocess.Popen:
    """One torchrun agent running ``tessera train`` as a subprocess (stdout and stderr piped); ``cores``:
    the CPUs it and its ranks may use (a "machine" of their own when two agents share this one)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
           f"--rdzv-id={run_id or uuid.uuid4().hex[:8]}", f"--monitor-interval={monitor_interval}",
           "-m", "tessera", "train", *args]
    # the agent reads this: the ranks' group gets its own store, so a restarted group always forms
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=pin)


class Lines:
    """Reads a pipe in a thread, keeping each line with the time it arrived."""

    def __init__(self, pipe):
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        for line in pipe:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        self.thread.join(timeout=10)
        return "\n".join(line for _, line in self.lines)

    def first(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)


def workers(agent_pid: int) -> dict[int, psutil.Process]:
    """The agent's rank processes by global rank (read from their environment)."""
    found = {}
    for child in psutil.Process(agent_pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            found[int(env["RANK"])] = child
    return found


def stop(agent: subprocess.Popen) -> None:
    """Kill an agent that is still running, and its ranks first (they would outlive it)."""
    if agent.poll() is not None:
        return
    try:
        for child in psutil.Process(agent.pid).children(recursive=True):
            child.kill()
    except psutil.NoSuchProcess:
        pass
    agent.kill()
    agent.wait(timeout=30)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended (exit code {proc.returncode}) before {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def train_losses(run: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


def trainer_worker(rank, world_size, args):
    return run_rank(load_config(None, args))


def one_thread_per_rank(nproc: int) -> set[int] | None:
    """CPUs for a torchrun agent of ``nproc`` local ranks on which each rank runs ONE torch thread, as
    each rank of the rank pool's reference run does. ``run_rank`` gives a rank usable_cores() //
    LOCAL_WORLD_SIZE threads, and a different thread count may change a matmul's summation order, so
    a bit-exact comparison needs the same count whatever this machine's core count: pin the agent (and
    so its ranks) to ``nproc`` cores. With fewer cores than ranks the count is already 1 (None: no pin)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return set(cores[:nproc]) if len(cores) >= nproc else None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is a Linux interface")
def test_the_pinned_agent_gives_each_rank_the_reference_runs_one_thread(monkeypatch, tmp_path, corpus_cache):
    """What ``run_rank`` does with the pinned affinity, in this process: 1 torch thread, whatever the
    machine (the kill -9 test's bit-exact comparison with the rank pool depends on it)."""
    from tessera.train import trainer

    seen = {}

    class Counting:  # stands in for the Trainer: records the threads run_rank chose, trains nothing
        def __init__(self, cfg, device):
            seen["threads"] = torch.get_num_threads()

        def fit(self):
            return {}

        def close(self):
            pass

    monkeypatch.setattr(trainer, "Trainer", Counting)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for key in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    before_threads, before_cores = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        pinned = one_thread_per_rank(2)
        if pinned is not None:
            os.sched_setaffinity(0, pinned)
        run_rank(load_config(None, job_args(tmp_path, corpus_cache, "threads")))
    finally:
        os.sched_setaffinity(0, before_cores)
        torch.set_num_threads(before_threads)
    assert seen["threads"] == 1


_REFERENCE: dict = {}  # run once per session, shared with tests/test_multinode.py


@pytest.fixture
def reference(rank_pool, tmp_path_factory, corpus_cache):
    """The undisturbed run: 2 ranks, same configuration, checkpoints every EVERY steps (all kept).
    Returns its summary and run folder."""
    if "run" not in _REFERENCE:
        out = tmp_path_factory.mktemp("reference")
        summary = rank_pool.run(trainer_worker, 2, args=job_args(out, corpus_cache, "ref"))[0]
        _REFERENCE["run"] = (summary, out / "ref")
    return _REFERENCE["run"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_of_a_rank_restarts_and_resumes_with_the_undisturbed_loss(tmp_path, corpus_cache, reference):
    ref_summary, ref_run = reference
    run = tmp_path / "job"
    # the agent looks at its ranks every 0.5 s: time for the survivor to meet the closed connection and
    # say so before the agent stops it
    # pinned: one torch thread per rank, as in the reference run, however many cores this machine has
    agent = torchrun(2, job_args(tmp_path, corpus_cache, "job"), monitor_interval=0.5, cores=one_thread_per_rank(2))
    out, err = Lines(agent.stdout), Lines(agent.stderr)
    try:
        # mid-interval: the checkpoint of step 10 is written and a step or more after it is done
        seen = wait_for(lambda: (run / "checkpoint" / "step_000010" / "trainer.json").exists()
                        and (read_progress(run) or 0) >= 12 and read_progress(run), 150,
                        "step 12 after the checkpoint of step 10", agent)
        victim = wait_for(lambda: workers(agent.pid).get(1), 10, "rank 1's process")
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        agent.wait(timeout=180)
    finally:
        stop(agent)
    stderr = err.text()
    assert agent.returncode == 0, stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restart_count"] == 1
    assert summary["resumed_from_step"] >= 10 and summary["resumed_from_step"] % EVERY == 0
    # reported: the steps the failed attempt did after its last checkpoint, at least those seen done
    assert 0 <= summary["steps_lost"] <= EVERY
    assert summary["resumed_from_step"] + summary["steps_lost"] >= seen
    # the surviving rank said in one sentence why it stopped
    assert "tessera: error: rank 0: " in stderr and "failed because peer rank 1 is gone" in stderr, stderr[-3000:]
    # the resumed job repeats the undisturbed run exactly: same layout, same random states
    assert summary["val_loss_end"] == ref_summary["val_loss_end"]
    assert train_losses(run) == train_losses(ref_run)
    resumed_at = err.first("resuming from")
    assert resumed_at is not None, stderr[-3000:]
    print(f"\nkill -9 of rank 1 at step {seen}: resumed from step "
          f"{summary['resumed_from_step']}, {summary['steps_lost']} steps lost, "
          f"{resumed_at - killed_at:.1f} s from the kill to the resumed ranks' first line")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_restart_with_one_rank_reshards_the_two_rank_checkpoint(tmp_path, corpus_cache, reference):
    """Continue the 2-rank run's step-10 checkpoint on 1 process: the losses after it match the
    uninterrupted 2-rank run within fp32 tolerance."""
    ref_summary, ref_run = reference
    checkpoint = ref_run / "checkpoint" / "step_000010"
    args = job_args(tmp_path, corpus_cache, "one")[:-1] + [f"--checkpoint.resume={checkpoint}"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank; more threads than free cores make tiny matmuls crawl
    try:
        summary = run_rank(load_config(None, args))
    finally:
        torch.set_num_threads(threads)
    assert summary["resumed_from_step"] == 10 and summary["layout"].startswith("1 rank")
    got, ref = train_losses(Path(summary["run_dir"])), train_losses(ref_run)
    assert sorted(got) == list(range(11, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-5), step
    assert summary["val_loss_end"] == pytest.approx(ref_summary["val_loss_end"], rel=1e-5)


def test_tesseras_own_agent_restarts_ranks_with_a_store_of_their_own(monkeypatch, corpus_cache, tmp_path):
    """`tessera train` without torchrun: run.max_restarts reaches the agent, and while the agent runs the
    ranks' group is told to use its own TCP store (then the environment is as it was)."""
    import torch.distributed.launcher.api as api

    from tessera.launch import launch_local

    seen = {}

    def fake_launch(config, entry):
        seen["max_restarts"] = config.max_restarts
        seen["store"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        return lambda cfg: {0: {"rank": 0}}

    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    cfg = load_config(None, job_args(tmp_path, corpus_cache, "own") + ["--run.max_restarts=3"])
    assert launch_local(cfg, 2) == {"rank": 0}
    assert seen == {"max_restarts": 3, "store": "1"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ
