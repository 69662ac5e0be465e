"""The trainer's pipeline adapter (PipelineStep) on gloo ranks against one process running
``tessera.train.step.forward_backward`` + ``tessera.grad_norm.clip_grad_norm`` + AdamW, with clipping active."""

import json
import math
import os

import pytest
import torch

from tessera.comm import CommGroup
from tessera.data_parallel import DDPConfig
from tessera.grad_norm import clip_grad_norm
from tessera.models import Transformer, model_config
from tessera.pipeline import PipelineConfig
from tessera.topology import ParallelConfig, Topology
from tessera.train.optim import OptimConfig, build_optimizer
from tessera.train.pipeline_step import PipelineStep
from tessera.train.step import IGNORE_INDEX, evaluate, forward_backward

GLOBAL_BATCH, SEQ, STEPS, LAYERS = 8, 16, 3, 4
SAMPLER_MICRO = 2  # micro-batches the data sampler hands each dp rank per step
MAX_NORM = 0.05  # well below the tiny model's gradient norm, so clipping happens at every step
# lr small enough that Adam's near sign(g) first updates of near-zero gradient elements (clipped gradients
# are tiny) stay within fp32 summation-order noise, large enough that every step moves weights by ~1e-3.
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=MAX_NORM)


def make_model(tie: bool, spare: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", n_layers=LAYERS, tie_embeddings=tie))
    if spare:  # a parameter of stage 0 that no forward reaches (made after the model: its weights are unchanged)
        model.layers["0"].spare = torch.nn.Linear(4, 4)
    return model


def global_batch(step: int):
    """x_BS, y_BS; some targets of the first sequence ignored, so dp ranks hold unequal token counts."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    y = x[:, 1:].clone()
    y[0, : 3 + step] = IGNORE_INDEX
    return x[:, :-1], y


def sampler_batches(step: int, dp_rank: int, dp: int):
    """What the trainer's sampler gives dp rank ``dp_rank``: its slice, in SAMPLER_MICRO micro-batches."""
    x, y = global_batch(step)
    per = GLOBAL_BATCH // dp
    x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    return list(zip(x.chunk(SAMPLER_MICRO), y.chunk(SAMPLER_MICRO)))


def val_batches(dp_rank: int, dp: int):
    return [sampler_batches(100 + i, dp_rank, dp) for i in range(2)]


def single_process(dp: int, tie: bool, spare: bool = False):
    """One process on the same global batches (dp replicas' micro-batches in rank order)."""
    model = make_model(tie, spare)
    opt = build_optimizer(model, OPTIM)
    single = CommGroup.single("dp")
    losses, norms = [], []
    for step in range(STEPS):
        batches = [mb for r in range(dp) for mb in sampler_batches(step, r, dp)]
        losses.append(forward_backward(model, batches, single, torch.device("cpu")).loss)
        norms.append(clip_grad_norm(model.parameters(), {}, MAX_NORM))  # one process: no norm axes
        opt.step()
        opt.zero_grad(set_to_none=True)
    val = [[mb for r in range(dp) for mb in val_batches(r, dp)[i]] for i in range(2)]
    ev = evaluate(model, val, single, torch.device("cpu"))
    moved = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(),
                                                               make_model(tie, spare).state_dict().values()))
    return {"losses": losses, "norms": norms, "eval": ev, "moved": moved,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def step_worker(rank, world_size, pp, schedule, m, v=1, tie=False, steps=STEPS, timeline_dir=None,
                ddp=DDPConfig(), spare=False):
    topo = Topology.build(ParallelConfig(pp=pp, dp_replicate=world_size // pp, timeout_s=60))
    try:
        dp = topo.group("dp")
        cfg = PipelineConfig(schedule=schedule, microbatches=m, virtual_stages=v)
        ps = PipelineStep(make_model(tie, spare), cfg, topo, torch.device("cpu"), OPTIM, ddp=ddp)
        losses, norms, dp_all_reduces = [], [], []
        for step in range(steps):
            mark = topo.ledger.stats()
            result = ps.forward_backward(sampler_batches(step, dp.rank, dp.size))
            stat = topo.ledger.since(mark).get(("dp", "all_reduce"))
            dp_all_reduces.append(stat.count if stat else 0)
            if step == 0:
                spare_grad = _grad_state(ps)
            losses.append(result.loss)
            norms.append(ps.clip_grad_norm(MAX_NORM))  # PipeDream: the norm of its in-schedule update
            if not ps.steps_inside:
                ps.optimizer.step()
            ps.optimizer.zero_grad(set_to_none=True)
        out = {"losses": losses, "norms": norms, "eval": ps.evaluate(val_batches(dp.rank, dp.size)),
               "params": {k: v.detach().clone() for k, v in ps.state_dict().items()},
               "names": sorted(n for n, _ in ps.named_parameters()), "tokens": result.tokens,
               "dp_rank": dp.rank, "pp_rank": topo.coord("pp"), "spare_grad": spare_grad,
               "n_buckets": len(ps.reducer.buckets) if ps.reducer else 0, "dp_all_reduces": dp_all_reduces}
        if timeline_dir is not None:
            out["timeline"] = ps.write_timeline(timeline_dir)
        return out
    finally:
        topo.destroy()


def _grad_state(ps) -> str | None:
    """The spare parameter's gradient after a step's reduction: "none", "zeros" or "values" (None: not here)."""
    layer = ps.module.layers["0"] if "0" in ps.module.layers else None
    if layer is None or not hasattr(layer, "spare"):
        return None
    grad = layer.spare.weight.grad
    return "none" if grad is None else ("zeros" if not grad.any() else "values")


def assert_matches(results, ref, pp):
    """Every rank's losses, norms, eval and stage weights equal the single process's; merged, the stages
    of one replica hold exactly the full model's parameter names."""
    merged = {}
    replica0 = sorted((r for r in results if r["dp_rank"] == 0), key=lambda r: r["pp_rank"])
    assert len(replica0) == pp
    for r in replica0:  # dp replica 0's pp ranks hold every stage once
        merged.update(r["params"])
        assert set(r["names"]) <= set(r["params"])  # named_parameters uses the full model's names
    assert sorted(merged) == sorted(ref["params"])
    assert all(n > MAX_NORM for n in ref["norms"])  # clipping was active at every step
    assert ref["moved"] > 1e-3  # training moved weights far beyond the comparison tolerance
    for r in results:
        assert r["losses"] == results[0]["losses"]  # the very same floats on every rank
        assert r["eval"] == results[0]["eval"]
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert r["eval"] == pytest.approx(ref["eval"], rel=1e-5)
    for r in results:  # every replica of a stage equals the single process
        for k, v in r["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=1e-5, atol=2e-5, msg=lambda s, k=k: f"{k}: {s}")


CASES = [  # (world, pp, schedule, microbatches, virtual stages, tie_embeddings)
    (2, 2, "1f1b", 4, 1, False),
    (2, 2, "gpipe", 4, 1, True),
    (2, 2, "interleaved", 4, 2, False),
    (4, 2, "1f1b", 2, 1, False),
    (2, 2, "pipedream", 1, 1, False),  # one micro-batch: PipeDream's in-schedule update is synchronous
]


@pytest.mark.parametrize("world,pp,schedule,m,v,tie", CASES,
                         ids=["1f1b-pp2", "gpipe-pp2-tied", "interleaved-pp2-v2", "1f1b-dp2xpp2",
                              "pipedream-m1-pp2"])
def test_pipeline_step_matches_single_process(rank_pool, world, pp, schedule, m, v, tie):
    results = rank_pool.run(step_worker, world, pp=pp, schedule=schedule, m=m, v=v, tie=tie)
    assert_matches(results, single_process(world // pp, tie), pp)
    assert results[0]["tokens"] == GLOBAL_BATCH * SEQ - (3 + STEPS - 1)  # the global count, ignored excluded
    if tie:  # the embedding and the tied head stayed bit-identical on their two ranks
        (head,) = [r["params"]["output.weight"] for r in results if "output.weight" in r["params"]]
        (emb,) = [r["params"]["tok_embeddings.weight"] for r in results if "tok_embeddings.weight" in r["params"]]
        torch.testing.assert_close(head, emb, rtol=0, atol=0)


def test_write_timeline_writes_trace_and_gantt(rank_pool, tmp_path):
    results = rank_pool.run(step_worker, 2, pp=2, schedule="1f1b", m=4, steps=2, timeline_dir=str(tmp_path))
    bubbles = [r["timeline"]["bubble_fraction"] for r in results]
    assert bubbles[0] == bubbles[1] and 0.0 < bubbles[0] < 1.0
    assert os.path.getsize(tmp_path / "timeline.png") > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # the last step only: 4 forwards and 4 backwards on each of the 2 ranks
    for rank in (0, 1):
        names = [e["name"] for e in spans if e["tid"] == rank and e["cat"] == "compute"]
        assert sum(n.startswith("F") for n in names) == 4 and sum(n.startswith("B") for n in names) == 4
    assert all(math.isfinite(e["dur"]) for e in spans)


@pytest.mark.parametrize("bucket_mb", [25.0, 0.01])
def test_pipeline_dp_reduction_takes_ddp_bucket_mb(rank_pool, bucket_mb):
    """The stage gradients are summed over dp by the data-parallel reducer in ``ddp.bucket_mb`` buckets:
    one all-reduce per bucket (plus the token count and the loss), and the result is unchanged."""
    results = rank_pool.run(step_worker, 4, pp=2, schedule="1f1b", m=2, ddp=DDPConfig(bucket_mb=bucket_mb))
    assert_matches(results, single_process(2, False), 2)
    for r in results:
        assert (r["n_buckets"] == 1) if bucket_mb == 25.0 else (r["n_buckets"] > 5)
        assert r["dp_all_reduces"] == [r["n_buckets"] + 2] * STEPS


@pytest.mark.parametrize("find_unused", [True, False])
def test_pipeline_dp_reduction_takes_find_unused_parameters(rank_pool, find_unused):
    """A stage parameter no micro-batch reached on any dp rank keeps grad=None with
    ``ddp.find_unused_parameters`` (AdamW then leaves it alone, as in one process); without it, it gets
    zeros (and only AdamW's decoupled weight decay moves it, by (1 - lr·wd) per step)."""
    results = rank_pool.run(step_worker, 4, pp=2, schedule="1f1b", m=2, spare=True,
                            ddp=DDPConfig(find_unused_parameters=find_unused))
    ref = single_process(2, False, spare=True)
    if not find_unused:
        ref["params"]["layers.0.spare.weight"] *= (1 - OPTIM.lr * OPTIM.weight_decay) ** STEPS
    assert_matches(results, ref, 2)
    holders = [r for r in results if r["pp_rank"] == 0]
    assert len(holders) == 2 and all(r["spare_grad"] == ("none" if find_unused else "zeros") for r in holders)
    for r in results:  # the holder count is one more small all-reduce over dp per step
        assert r["dp_all_reduces"] == [r["n_buckets"] + 2 + find_unused] * STEPS


def scale_worker(rank, world_size):
    topo = Topology.build(ParallelConfig(pp=2, dp_replicate=world_size // 2, timeout_s=60))
    try:
        dp = topo.group("dp")
        ps = PipelineStep(make_model(False), PipelineConfig(schedule="1f1b", microbatches=2), topo,
                          torch.device("cpu"), OPTIM)
        grads, losses = {}, []
        for scale in (1.0, 1024.0):
            losses.append(ps.forward_backward(sampler_batches(0, dp.rank, dp.size), loss_scale=scale).loss)
            grads[scale] = [p.grad.clone() for p in ps.parameters()]
            finite = ps.unscale_gradients(1.0 / scale)
            unscaled = [p.grad.clone() for p in ps.parameters()]
            ps.zero_grad()
        return {"scaled": all(torch.equal(b, a * 1024) for a, b in zip(grads[1.0], grads[1024.0])),
                "unscaled": all(torch.equal(a, b) for a, b in zip(grads[1.0], unscaled)), "finite": finite,
                "losses": losses}
    finally:
        topo.destroy()


def test_pipeline_applies_and_divides_out_a_loss_scale(rank_pool):
    """forward_backward(loss_scale=S) gives S times the gradients (exactly, S a power of two) and the
    same reported loss; unscale_gradients(1/S) gives back the unscaled ones and agrees they are finite."""
    res = rank_pool.run(scale_worker, 4)
    assert all(r["scaled"] and r["unscaled"] and r["finite"] for r in res)
    assert all(r["losses"][0] == r["losses"][1] == res[0]["losses"][0] for r in res)


def async_worker(rank, world_size, pp, schedule):
    topo = Topology.build(ParallelConfig(pp=pp, dp_replicate=world_size // pp, timeout_s=60))
    try:
        dp = topo.group("dp")
        ps = PipelineStep(make_model(False), PipelineConfig(schedule=schedule, microbatches=4), topo,
                          torch.device("cpu"), OPTIM)
        before = {k: v.clone() for k, v in ps.state_dict().items()}
        losses, norms = [], []
        for step in range(2):
            losses.append(ps.forward_backward(sampler_batches(step, dp.rank, dp.size)).loss)
            norms.append(ps.clip_grad_norm(MAX_NORM))  # PipeDream: the norm of its in-schedule update
            if not ps.steps_inside:
                ps.optimizer.step()
            ps.optimizer.zero_grad(set_to_none=True)
        moved = max(float((v - before[k]).abs().max()) for k, v in ps.state_dict().items())
        return {"losses": losses, "norms": norms, "moved": moved, "inside": ps.steps_inside,
                "params": ps.state_dict(), "pp_rank": topo.coord("pp")}
    finally:
        topo.destroy()


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_async_schedules_train_on_dp2_x_pp2(rank_pool, schedule):
    """PipeDream (4 in-schedule updates per batch, each clipped over pp and reduced over dp) and 2BW (the
    trainer's update, batch t on version t-1) run on 4 ranks without hanging; ranks agree on the loss and
    the dp replicas of a stage stay identical."""
    res = rank_pool.run(async_worker, 4, pp=2, schedule=schedule)
    assert all(r["inside"] == (schedule == "pipedream") for r in res)
    for r in res:
        assert r["losses"] == res[0]["losses"] and all(math.isfinite(x) for x in r["losses"])
        assert all(n > MAX_NORM for n in r["norms"]) and r["moved"] > 1e-4
    for a in res:
        for b in res:
            if a["pp_rank"] == b["pp_rank"]:
                for k, v in a["params"].items():
                    torch.testing.assert_close(b["params"][k], v, rtol=0, atol=0)


def checkpoint_worker(rank, world_size, path):
    from pathlib import Path

    from tessera.train.checkpoint import load_training_state, save_training_state

    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=60))
    try:
        cfg = PipelineConfig(schedule="1f1b", microbatches=2)
        ps = PipelineStep(make_model(False), cfg, topo, torch.device("cpu"), OPTIM)
        ps.forward_backward(sampler_batches(0, 0, 1))
        ps.clip_grad_norm(MAX_NORM)
        ps.optimizer.step()
        ps.optimizer.zero_grad(set_to_none=True)
        save_training_state(Path(path), {"step": 1}, ps.module, ps.optimizer, None, topo)
        fresh = PipelineStep(make_model(False), cfg, topo, torch.device("cpu"), OPTIM)
        load_training_state(Path(path), fresh.module, fresh.optimizer, None, topo)
        same_state = all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in
                         zip(ps.optimizer.state.values(), fresh.optimizer.state.values()))
        same_params = all(torch.equal(v, fresh.state_dict()[k]) for k, v in ps.state_dict().items())
        return {"params": ps.state_dict(), "same_state": same_state and len(fresh.optimizer.state) > 0,
                "same_params": same_params}
    finally:
        topo.destroy()


def test_checkpoint_of_stages_loads_into_full_model_and_back(rank_pool, tmp_path):
    """save_training_state(ps.module, ps.optimizer): the stages' parameters under full names, written once;
    they reload into a fresh PipelineStep (weights and AdamW state) and into one unpipelined Transformer."""
    from tessera.train.checkpoint import load_model

    path = tmp_path / "ckpt"
    res = rank_pool.run(checkpoint_worker, 2, path=str(path))
    assert all(r["same_params"] and r["same_state"] for r in res)
    full = make_model(False)
    load_model(path, full)
    merged = {**res[0]["params"], **res[1]["params"]}
    assert sorted(merged) == sorted(full.state_dict())
    for k, v in full.state_dict().items():
        torch.testing.assert_close(v, merged[k], rtol=0, atol=0)
