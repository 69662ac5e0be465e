"""PipeDream async (weight stashing, vertical sync) and PipeDream-2BW: each micro-batch's forward and backward
run on the weight version the schedule defines, on 2 gloo ranks."""

import pytest
import torch

from tessera.models import Transformer, cross_entropy_sum, model_config
from tessera.pipeline import PipelineConfig, build_pipeline
from tessera.topology import ParallelConfig, Topology

M, CALLS = 4, 3


def checksum(module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def async_worker(rank, world_size, schedule, vertical_sync):
    topo = Topology.build(ParallelConfig(pp=world_size, dp_replicate=1, timeout_s=60))
    try:
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", n_layers=2))
        history = []  # live weights' checksum per version (per update of this rank)
        holder = {}

        def on_step():  # PipeDream: one update per micro-batch backward
            holder["opt"].step()
            holder["opt"].zero_grad(set_to_none=True)
            history.append(checksum(stage))

        cfg = PipelineConfig(schedule=schedule, microbatches=M, vertical_sync=vertical_sync)
        pipe = build_pipeline(model, cfg, topo.group("pp"),
                              lambda out, y: cross_entropy_sum(out, y)[0] / y.numel(), on_step=on_step)
        (stage,) = pipe.stages.values()
        holder["opt"] = torch.optim.SGD(pipe.parameters(), lr=0.5)
        history.append(checksum(stage))
        g = torch.Generator().manual_seed(1)
        for _ in range(CALLS):
            x = torch.randint(0, 256, (2 * M, 9), generator=g)
            pipe.step(list(zip(x[:, :-1].chunk(M), x[:, 1:].chunk(M))))
            if schedule == "2bw":  # one update per batch, by the trainer
                holder["opt"].step()
                holder["opt"].zero_grad(set_to_none=True)
                history.append(checksum(stage))
        return {"log": pipe.executor.versions.log, "history": history}
    finally:
        topo.destroy()


def per_mb(log, kind):
    return [e["version"] for e in log if e["kind"] == kind]


def check_stashing(res):
    for r in res:
        fwd = [e for e in r["log"] if e["kind"] == "F"]
        bwd = {(i // M, e["mb"]): e for i, e in enumerate(e for e in r["log"] if e["kind"] == "B")}
        for i, f in enumerate(fwd):
            b = bwd[(i // M, f["mb"])]
            assert b["version"] == f["version"]
            # The weights the backward's graph holds are exactly the version's weights, not the live ones.
            assert b["sum"] == f["sum"] == pytest.approx(r["history"][f["version"]], rel=0, abs=1e-9)


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_backward_uses_the_stashed_version(rank_pool, vertical_sync):
    res = rank_pool.run(async_worker, 2, schedule="pipedream", vertical_sync=vertical_sync)
    check_stashing(res)
    # 1F1B without flush, one update after each backward: rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3, rank 1
    # F B F B ...; so rank 0's micro-batches see versions 0,0,1,2 and rank 1's 0,1,2,3 (+4 per call).
    assert per_mb(res[0]["log"], "F") == [0, 0, 1, 2, 4, 4, 5, 6, 8, 8, 9, 10]
    expect1 = [0, 0, 1, 2, 4, 4, 5, 6, 8, 8, 9, 10] if vertical_sync else list(range(12))
    assert per_mb(res[1]["log"], "F") == expect1
    assert len(set(res[1]["history"])) == len(res[1]["history"])  # every update changed the weights


def test_2bw_uses_the_previous_batch_version(rank_pool):
    res = rank_pool.run(async_worker, 2, schedule="2bw", vertical_sync=False)
    check_stashing(res)
    for r in res:  # batch t runs on version t-1 (two buffers), batch 0 on version 0
        assert per_mb(r["log"], "F") == [0] * M + [0] * M + [1] * M
    assert res[0]["history"][0] != res[0]["history"][1]
