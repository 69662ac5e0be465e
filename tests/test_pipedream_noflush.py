"""PipeDream and PipeDream-2BW without a flush (``pipeline.flush = false``): the schedule continues across
optimizer steps, every micro-batch's backward runs on the weight version its forward used, the versions
follow the papers' rule over the whole stream of micro-batches, and the step boundary has no bubble."""

import json

import pytest
import torch

from tessera.errors import ConfigError
from tessera.models import Transformer, cross_entropy_sum, model_config
from tessera.pipeline import PipelineConfig, build_pipeline, build_schedule, check, verify_complete
from tessera.pipeline.measure import boundary_idle, measure_steps
from tessera.pipeline.schedules import concatenate, continuing_schedule
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config, validate_config

from test_trainer import tiny_args, trainer_worker

M, STEPS = 4, 3


# ---- schedules as data ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pipedream", "2bw"])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_a_step_that_starts_and_ends_drained_is_todays_schedule(name, pp):
    """warm-up + cool-down in one step is exactly the flush schedule; with pp = 1 nothing is ever in
    flight, so every variant is the flush schedule (the mode reduces to today's)."""
    flush = build_schedule(name, pp, M)
    assert continuing_schedule(name, pp, M, warm=True, lookahead=False).actions == flush.actions
    if pp == 1:
        for warm in (True, False):
            for look in (True, False):
                assert continuing_schedule(name, pp, M, warm, look).actions == flush.actions


def _simulate(name, pp, m, steps, flush):
    sched = concatenate([continuing_schedule(name, pp, m, warm=flush or t == 0,
                                             lookahead=not flush and t < steps - 1) for t in range(steps)])
    verify_complete(sched)  # every micro-batch of every step: F and B once on each stage
    report = check(sched)  # no deadlock, messages in order, dependencies kept across step boundaries
    return report, boundary_idle(report.intervals, m, steps)


@pytest.mark.parametrize("name", ["pipedream", "2bw"])
@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 6)])
def test_no_flush_has_no_idle_slot_at_step_boundaries(name, pp, m):
    """Unit-time simulation (F = 1, B = 2): without a flush, in the steady state (t >= 1), every rank is
    busy from the end of its last forward of step t to its first backward of step t+1; a flush leaves
    idle slots there on every rank, and the run's bubble falls from (p-1)/(m+p-1) to (p-1)/(steps*m+p-1)."""
    steps = 5
    report, idle = _simulate(name, pp, m, steps, flush=False)
    # boundary 0 still holds the very first warm-up's fill (its step's last forwards are warm-up ones)
    assert [row[1:] for row in idle] == [[0.0] * (steps - 2)] * pp
    assert report.bubble == pytest.approx((pp - 1) / (steps * m + pp - 1))
    flushed, idle_f = _simulate(name, pp, m, steps, flush=True)
    assert all(x > 0 for row in idle_f for x in row), idle_f
    assert flushed.bubble == pytest.approx((pp - 1) / (m + pp - 1))


def test_flush_false_is_refused_where_it_cannot_work():
    PipelineConfig(schedule="2bw", microbatches=4, flush=False).validate(pp=4)
    with pytest.raises(ConfigError, match="applies only to the weight-stashing"):
        PipelineConfig(schedule="1f1b", flush=False).validate(pp=2)
    with pytest.raises(ConfigError, match="at least as many micro-batches as stages"):
        PipelineConfig(schedule="pipedream", microbatches=2, flush=False).validate(pp=4)
    with pytest.raises(ConfigError, match="dynamic loss scale"):
        PipelineConfig(schedule="2bw", flush=False).validate(pp=2, routing_losses=True, dynamic_loss_scale=True)


def test_flush_key_outside_the_weight_stashing_schedules_is_refused_before_launch(tmp_path):
    args = ["--model.preset=tiny", "--parallel.pp=2", "--pipeline.schedule=2bw", "--pipeline.flush=false",
            f"--run.out_dir={tmp_path}"]
    validate_config(load_config(None, args), 2)
    with pytest.raises(ConfigError, match="applies only to the weight-stashing schedules"):
        validate_config(load_config(None, [*args, "--pipeline.schedule=1f1b"]), 2)


# ---- weight versions on gloo ranks ----------------------------------------------------------------------

def checksum(module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def versions_worker(rank, world_size, schedule, vertical_sync, flush, drains=()):
    """STEPS steps of a one-layer-per-stage tiny Transformer; without a flush each step gets the next one's
    micro-batches, except the last and those in ``drains``, which drain. Returns the executor's version log, the live weights' checksum per
    update and each step's summed loss."""
    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=60))
    try:
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", n_layers=world_size))
        history, holder = [], {}

        def update():
            holder["opt"].step()
            holder["opt"].zero_grad(set_to_none=True)
            history.append(checksum(stage))

        cfg = PipelineConfig(schedule=schedule, microbatches=M, vertical_sync=vertical_sync, flush=flush)
        pipe = build_pipeline(model, cfg, topo.group("pp"), lambda out, y: cross_entropy_sum(out, y)[0] / y.numel(),
                              on_step=update if schedule == "pipedream" else None)
        (stage,) = pipe.stages.values()
        holder["opt"] = torch.optim.SGD(pipe.parameters(), lr=0.5)
        history.append(checksum(stage))
        g = torch.Generator().manual_seed(1)
        xs = [torch.randint(0, 256, (2 * M, 9), generator=g) for _ in range(STEPS)]
        micro = [list(zip(x[:, :-1].chunk(M), x[:, 1:].chunk(M))) for x in xs]
        losses = []
        for t in range(STEPS):
            out = pipe.step(micro[t], None if flush or t == STEPS - 1 or t in drains else micro[t + 1])
            losses.append(float(pipe.loss(out)))
            if schedule == "2bw":  # one update per batch, by the trainer
                update()
        assert pipe.executor.drained
        return {"log": pipe.executor.versions.log, "history": history, "losses": losses, "stage": rank,
                "final": checksum(stage)}
    finally:
        topo.destroy()


def check_stashing(res):
    """(1) every micro-batch's B ran on exactly the version (and the very weights) its F used."""
    for r in res:
        fwd = {e["g"]: e for e in r["log"] if e["kind"] == "F"}
        bwd = {e["g"]: e for e in r["log"] if e["kind"] == "B"}
        assert sorted(fwd) == sorted(bwd) == list(range(STEPS * M))
        for g, f in fwd.items():
            assert bwd[g]["version"] == f["version"], g
            assert bwd[g]["sum"] == f["sum"] == pytest.approx(r["history"][f["version"]], rel=0, abs=1e-9)


def _drained_before(g, drains):
    """Micro-batches done (= updates applied) at the last drain before micro-batch g: a drain after step d
    ends with (d+1)*M done."""
    return max([0] + [(d + 1) * M for d in drains if (d + 1) * M <= g])


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_pipedream_no_flush_versions_follow_the_paper(rank_pool, world):
    """(1) stashing across step boundaries; (2) PipeDream's rule over the stream of micro-batches: micro-batch
    g at stage s of S runs on version max(0, g - (S-1-s)), i.e. the weights updated with micro-batches up
    to g - (S-s); vertical sync: every stage on stage 0's version max(0, g - (S-1)). After a drain that
    ends with d micro-batches done, the clamp is d: max(d, g - lag) (pp2: also with a drain after step 1)."""
    cases = [(v, ()) for v in (False, True)] + ([(False, (1,)), (True, (1,))] if world == 2 else [])
    for vertical_sync, drains in cases:
        res = rank_pool.run(versions_worker, world, schedule="pipedream", vertical_sync=vertical_sync, flush=False,
                            drains=drains)
        check_stashing(res)
        for r in res:
            lag = world - 1 if vertical_sync else world - 1 - r["stage"]
            got = {e["g"]: e["version"] for e in r["log"] if e["kind"] == "F"}
            assert got == {g: max(_drained_before(g, drains), g - lag) for g in range(STEPS * M)}, (
                r["stage"], vertical_sync, drains)
            assert len(set(r["history"])) == len(r["history"])  # every update changed the weights
        if drains:
            continue
        # stage 0's first world-1 forwards of steps 1.. ran in the previous step's cool-down slots
        pos = {(e["kind"], e["g"]): i for i, e in enumerate(res[0]["log"])}
        for t in range(1, STEPS):
            for j in range(world - 1):  # F of step t's micro-batch j before B of step t-1's last one
                assert pos[("F", t * M + j)] < pos[("B", t * M - 1)], (t, j)


@pytest.mark.multirank
def test_2bw_no_flush_equals_2bw_with_a_flush(rank_pool):
    """2BW's semantics (batch t on version t-1, on every stage) do not depend on the flush: same versions,
    the same losses and weights, bit for bit; only the timing changes."""
    nf = rank_pool.run(versions_worker, 2, schedule="2bw", vertical_sync=False, flush=False)
    fl = rank_pool.run(versions_worker, 2, schedule="2bw", vertical_sync=False, flush=True)
    check_stashing(nf)
    for a, b in zip(nf, fl):
        assert {e["g"]: e["version"] for e in a["log"] if e["kind"] == "F"} == {
            g: max(0, g // M - 1) for g in range(STEPS * M)}
        assert a["losses"] == b["losses"] and a["final"] == b["final"]
    pos = {(e["kind"], e["g"]): i for i, e in enumerate(nf[0]["log"])}
    assert pos[("F", M)] < pos[("B", M - 1)]  # step 1's first forward ran in step 0's cool-down slot


# ---- measured timeline ----------------------------------------------------------------------------------

def timeline_worker(rank, world_size, m, steps):
    """measure_steps' gathered events (stages that do not sleep: only the order is asserted, no timing)."""
    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=60))
    try:
        return {flush: [(e.rank, e.name, e.start, e.end) for e in
                        measure_steps(topo.group("pp"), "2bw", m, steps, flush, forward_s=0.0)["events"]]
                for flush in (True, False)}
    finally:
        topo.destroy()


@pytest.mark.multirank
def test_measured_timeline_runs_early_forwards_only_without_a_flush(rank_pool):
    """The benchmark's measured timeline (pp = 2, m = 2, 3 steps) holds every forward and backward once;
    rank 0 runs step t+1's first forward before step t's last backward only without a flush. (How much
    idle time this saves is measured by benchmarks/pipedream_noflush.py, not asserted here.)"""
    m, steps = 2, 3
    res = rank_pool.run(timeline_worker, 2, m=m, steps=steps, timeout=120)[0]
    want = {(r, f"{k}{r}.{g}") for r in range(2) for k in "FB" for g in range(steps * m)}
    for flush, events in res.items():
        names = [(r, name) for r, name, _, _ in events]
        assert sorted(names) == sorted(want), flush  # every action once, on its stage's rank
        at = {name: (start, end) for r, name, start, end in events if r == 0}
        for t in range(1, steps):  # one rank runs its actions one after another: the order is the schedule's
            early = at[f"F0.{t * m}"][0] < at[f"B0.{t * m - 1}"][0]
            assert early == (not flush), (flush, t)


# ---- the trainer ----------------------------------------------------------------------------------------

@pytest.mark.multirank
def test_trainer_2bw_without_a_flush_trains_like_with_one(rank_pool, tmp_path, corpus_cache):
    """``tessera train`` with pipeline.flush = false: steps 1, 2, 4, 5 hand their next step's batches
    ahead, validation (every 3 steps) and the final checkpoint drain; losses and validation equal the
    flushed run's exactly (2BW's versions do not depend on the flush)."""
    base = ["--parallel.pp=2", "--pipeline.schedule=2bw", "--pipeline.microbatches=2", "--model.n_layers=2"]
    got = {}
    for flush in ("true", "false"):
        args = tiny_args(tmp_path, corpus_cache, steps=6, extra=[*base, f"--pipeline.flush={flush}",
                                                                   f"--run.name=f{flush}"])
        summary = rank_pool.run(trainer_worker, 2, args=args, timeout=300)[0]
        lines = [json.loads(x) for x in (tmp_path / f"f{flush}" / "metrics.jsonl").read_text().splitlines()]
        got[flush] = (summary, lines)
    (s_t, l_t), (s_f, l_f) = got["true"], got["false"]
    assert [x.get("loss", x.get("val_loss")) for x in l_f] == [x.get("loss", x.get("val_loss")) for x in l_t]
    assert s_f["val_loss_end"] == s_t["val_loss_end"] and s_f["checkpoint"] is not None
    # the timeline kept since the drain at step 3 holds stage 0's forward of a next step's micro-batch
    # (number m = 2 within its step's actions) only without a flush
    names = {f: {e["name"] for e in json.loads((tmp_path / f"f{f}" / "trace.json").read_text())["traceEvents"]}
             for f in ("true", "false")}
    assert "F0.2" in names["false"] and "F0.2" not in names["true"]


def _run(rank_pool, tmp_path, corpus_cache, name, world, extra, steps=6):
    args = tiny_args(tmp_path, corpus_cache, steps=steps, extra=[*extra, f"--run.name={name}"])
    summary = rank_pool.run(trainer_worker, world, args=args, timeout=300)[0]
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, {(x["kind"], x["step"]): x.get("loss", x.get("val_loss")) for x in lines}


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [["--parallel.dp_replicate=2", "--precision.dtype=bf16"],
                                    ["--parallel.tp=2", "--parallel.dp_replicate=1"]], ids=["dp2-bf16", "tp2"])
def test_trainer_2bw_without_a_flush_composes(rank_pool, tmp_path, corpus_cache, layout):
    """pp2 x dp2 in bf16 (each stage's gradients reduced over dp once per update, as with a flush) and
    pp2 x tp2 (tensor-parallel stages): the losses equal the flushed run's exactly."""
    base = ["--parallel.pp=2", *layout, "--pipeline.schedule=2bw", "--pipeline.microbatches=2",
            "--model.n_layers=2", "--checkpoint.save_final=false"]
    s_t, l_t = _run(rank_pool, tmp_path, corpus_cache, "t", 4, [*base, "--pipeline.flush=true"], steps=4)
    s_f, l_f = _run(rank_pool, tmp_path, corpus_cache, "f", 4, [*base, "--pipeline.flush=false"], steps=4)
    assert l_f == l_t and len(l_f) >= 4


@pytest.mark.multirank
def test_pipedream_without_a_flush_resumes_exactly(rank_pool, tmp_path, corpus_cache):
    """A checkpoint is taken at a drained pipeline (validation and checkpoints drain it), with the sampler
    right after its step: a run resumed from step 3 goes on exactly as the uninterrupted one."""
    base = ["--parallel.pp=2", "--pipeline.schedule=pipedream", "--pipeline.microbatches=2", "--model.n_layers=2",
            "--model.tie_embeddings=false", "--pipeline.flush=false", "--train.eval_every=100",
            "--checkpoint.save_final=false"]
    s_a, l_a = _run(rank_pool, tmp_path, corpus_cache, "a", 2, [*base, "--checkpoint.every=3"])
    ckpt = tmp_path / "a" / "checkpoint" / "step_000003"
    s_b, l_b = _run(rank_pool, tmp_path, corpus_cache, "b", 2, [*base, f"--checkpoint.resume={ckpt}"])
    assert s_b["resumed_from_step"] == 3
    after = {k: v for k, v in l_a.items() if k[1] > 3}
    assert after and {k: l_b[k] for k in after} == after
    assert s_b["val_loss_end"] == s_a["val_loss_end"]
