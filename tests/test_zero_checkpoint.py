"""A ZeRO run saved and restored at the same layout continues exactly as if it had never stopped."""

import pytest
import torch

from tessera.models.layers import TransformerBlock
from tessera.precision import PrecisionConfig
from tessera.topology import ParallelConfig, Topology
from tessera.checkpoint import checkpoint_tensors
from tessera.train.checkpoint import load_training_state, save_training_state
from tessera.train.step import forward_backward
from tessera.zero import ZeroConfig
from tessera.zero.build import shard_model

from test_zero import CPU, local_micro_batches, make_model, make_optimizer, param_groups


def build(topo, stage, dtype):
    model = make_model()
    engine = shard_model(model, param_groups(model), make_optimizer, topo, stage, ZeroConfig(),
                         PrecisionConfig(dtype=dtype), CPU, block_class=TransformerBlock)
    return model, engine


def train(engine, dp, steps):
    for step in steps:
        forward_backward(engine, local_micro_batches(step, dp.rank, dp.size, 1), dp, CPU)
        engine.clip_grad_norm(1.0)
        engine.step()
        engine.zero_grad()


def state(engine, model):
    return engine.full_state() if hasattr(engine, "full_state") else {
        k: v.detach().clone() for k, v in model.state_dict().items()}


def resume_worker(rank, world_size, stage, dtype, folder):
    from pathlib import Path

    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size))
    try:
        dp, world = topo.group("dp"), topo.group("world")
        model, engine = build(topo, stage, dtype)
        train(engine, dp, range(2))
        save_training_state(Path(folder), {"step": 2}, model, engine.optimizer, engine, topo)
        train(engine, dp, range(2, 4))
        model2, resumed = build(topo, stage, dtype)  # fresh weights: the seed's, not the trained ones
        meta = load_training_state(Path(folder), model2, resumed.optimizer, resumed, topo)
        train(resumed, dp, range(2, 4))
        a, b = state(engine, model), state(resumed, model2)
        return {"meta": meta, "equal": all(torch.equal(a[k], b[k]) for k in a)}
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("stage,dtype", [(2, "fp32"), (3, "bf16")])
def test_zero_resumes_bit_exactly(rank_pool, tmp_path, stage, dtype):
    results = rank_pool.run(resume_worker, 2, stage=stage, dtype=dtype, folder=str(tmp_path / "ckpt"))
    assert all(r["equal"] for r in results) and results[0]["meta"] == {"step": 2}
    saved = checkpoint_tensors(tmp_path / "ckpt")  # single-process names and shapes, whatever the layout
    assert saved["model/output.weight"] == saved["optim/output.weight/exp_avg"] == (256, 32)
