"""Pipeline parallelism: every schedule on pp gloo ranks (and dp2 x pp2) against one process, fp32."""

import pytest
import torch

from tessera import comm
from tessera.comm import CommGroup
from tessera.models import Transformer, cross_entropy_sum, model_config
from tessera.pipeline import PipelineConfig, build_pipeline
from tessera.topology import ParallelConfig, Topology

GLOBAL_BATCH, SEQ, STEPS, LAYERS = 8, 16, 3, 8


def make_model(tie: bool = False) -> Transformer:
    torch.manual_seed(0)
    return Transformer(model_config("tiny", n_layers=LAYERS, tie_embeddings=tie))


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def micro_batches(step: int, dp_rank: int, dp: int, m: int):
    x, y = global_batch(step)
    per = GLOBAL_BATCH // dp
    x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    return list(zip(x.chunk(m), y.chunk(m)))


def make_opt(params):
    return torch.optim.AdamW(list(params), lr=1e-2, weight_decay=0.1)


def single_process(m: int, dp: int = 1, tie: bool = False):
    """One process, the same global batch cut the same way: ``dp`` replica slices of ``m`` micro-batches,
    gradients accumulated per slice and then summed over slices (the order the ranks sum them in)."""
    model = make_model(tie)
    opt = make_opt(model.parameters())
    tokens = float(GLOBAL_BATCH * SEQ)
    losses = []
    for step in range(STEPS):
        total, loss = None, 0.0
        for replica in range(dp):
            for x, y in micro_batches(step, replica, dp, m):
                s = cross_entropy_sum(model(x), y)[0] / tokens
                s.backward()
                loss += float(s.detach())
            grads = [p.grad.clone() for p in model.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
            opt.zero_grad(set_to_none=True)
        for p, g in zip(model.parameters(), total):
            p.grad = g
        losses.append(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():  # evaluation after training: the summed loss on batch 0
        x, y = global_batch(0)
        losses.append(float(cross_entropy_sum(model(x), y)[0] / tokens))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def pipeline_worker(rank, world_size, schedule, pp, m, v=1, tie=False, recompute=False):
    topo = Topology.build(ParallelConfig(pp=pp, dp_replicate=world_size // pp, timeout_s=60))
    try:
        dp_group, pp_group = topo.group("dp"), topo.group("pp")
        tokens = float(GLOBAL_BATCH * SEQ)  # global token count: no ignored targets here

        def loss_fn(logits, y):
            return cross_entropy_sum(logits, y)[0] / tokens

        cfg = PipelineConfig(schedule=schedule, microbatches=m, virtual_stages=v, recompute=recompute)
        pipe = build_pipeline(make_model(tie), cfg, pp_group, loss_fn)
        opt = make_opt(pipe.parameters())
        losses = []
        for step in range(STEPS):
            out = pipe.step(micro_batches(step, dp_group.rank, dp_group.size, pipe.schedule.n_microbatches))
            for p in pipe.parameters():  # DP x PP: sum gradients over the data-parallel replicas
                comm.all_reduce(p.grad, dp_group)
            loss = pipe.loss(out)
            comm.all_reduce(loss, dp_group)
            losses.append(float(loss))
            opt.step()
            opt.zero_grad(set_to_none=True)
        ev = pipe.evaluate(micro_batches(0, dp_group.rank, dp_group.size, 2))  # forward-only schedule
        comm.all_reduce(ev, dp_group)
        losses.append(float(ev))
        return {"losses": losses, "params": pipe.state_dict(), "peak": out.peak_activations}
    finally:
        topo.destroy()


def assert_matches(results, ref):
    ref_losses, ref_params = ref
    merged = {}
    for r in results:
        merged.update(r["params"])
    assert sorted(merged) == sorted(ref_params)  # every layer on exactly one stage
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for k, v in ref_params.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=2e-5, msg=lambda s, k=k: f"{k}: {s}")


CASES = [("naive", 1, 1), ("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2), ("zb-h1", 4, 1)]


@pytest.mark.parametrize("schedule,m,v", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("pp", [2, 4])
def test_schedule_matches_single_process(rank_pool, schedule, m, v, pp):
    results = rank_pool.run(pipeline_worker, pp, schedule=schedule, pp=pp, m=m, v=v)
    assert_matches(results, single_process(m))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_dp_x_pp_matches_single_process(rank_pool, schedule):
    results = rank_pool.run(pipeline_worker, 4, schedule=schedule, pp=2, m=2)
    assert_matches(results, single_process(2, dp=2))


def test_tied_embeddings_and_recompute_match_single_process(rank_pool):
    results = rank_pool.run(pipeline_worker, 2, schedule="1f1b", pp=2, m=4, tie=True, recompute=True)
    ref = single_process(4, tie=True)
    assert_matches(results, ref)
    first = results[0]["params"]["tok_embeddings.weight"]
    torch.testing.assert_close(results[1]["params"]["output.weight"], first, rtol=0, atol=0)
