"""Mixed precision: the loss scaler's rules, bf16/fp16 tracking the fp32 loss curve with fp32 master
weights, and an fp16 overflow that is skipped, logged and recovered from."""

import json

import pytest
import torch

from tessera.comm import CommGroup
from tessera.models import Transformer, model_config
from tessera.models.layers import TransformerBlock
from tessera.precision import LossScaler, PrecisionConfig
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config
from tessera.train.step import forward_backward
from tessera.train.trainer import Trainer
from tessera.zero import ZeroConfig
from tessera.zero.build import shard_model

CPU = torch.device("cpu")


def test_dynamic_scaler_halves_and_skips_on_overflow_and_grows_after_clean_steps():
    s = LossScaler(scale=1024.0, growth_interval=3)
    assert s.update(True) and s.update(True)
    assert not s.update(False) and s.scale == 512.0 and s.skipped == 1
    assert s.update(True) and s.update(True) and s.scale == 512.0
    assert s.update(True) and s.scale == 1024.0  # three clean steps in a row since the skip
    static = LossScaler.from_config(PrecisionConfig(dtype="bf16"))
    assert static.scale == 1.0 and not static.update(False) and static.scale == 1.0 and static.skipped == 1
    assert LossScaler.from_config(PrecisionConfig(dtype="fp16")).dynamic


def curve(dtype: str, stage: int, steps: int = 6) -> list[float]:
    """Losses of a tiny model trained on one process through the ZeRO engine in ``dtype``."""
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", dim=32, n_layers=2))
    topo = Topology.build(ParallelConfig(dp_replicate=1))
    groups = [{"params": list(model.parameters()), "weight_decay": 0.0}]
    precision = PrecisionConfig(dtype=dtype)
    engine = shard_model(model, groups, lambda g: torch.optim.AdamW(g, lr=3e-3), topo, stage, ZeroConfig(),
                         precision, CPU, block_class=TransformerBlock)
    scaler = LossScaler.from_config(precision)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step % 2)  # two batches, revisited: the loss must fall
        x = torch.randint(0, 256, (4, 17), generator=g)
        losses.append(forward_backward(engine, [(x[:, :-1], x[:, 1:])], CommGroup.single("dp"), CPU,
                                       loss_scale=scaler.scale).loss)
        _, finite = engine.clip_grad_norm(1.0, inv_scale=1.0 / scaler.scale)
        if scaler.update(finite):
            engine.step()
        engine.zero_grad()
    assert scaler.skipped == 0
    return losses


@pytest.mark.parametrize("dtype,stage,bound", [("bf16", 3, 0.01), ("fp16", 2, 0.01)])
def test_low_precision_tracks_the_fp32_loss_curve(dtype, stage, bound):
    ref, got = curve("fp32", stage), curve(dtype, stage)
    diff = max(abs(a - b) for a, b in zip(ref, got))
    print(f"\n{dtype} (ZeRO-{stage}) vs fp32: largest loss difference {diff:.4f} over {len(ref)} steps")
    assert ref[-1] < ref[0] - 0.1 and got[-1] < got[0] - 0.1  # both learn
    assert 0 < diff < bound  # close, yet really computed in another precision


def test_fp16_forced_overflow_is_skipped_logged_and_recovered(tmp_path, corpus_cache, capsys):
    cfg = load_config(None, [
        "--model.preset=tiny", "--train.steps=6", "--train.log_every=1", "--train.eval_every=6",
        "--data.seq_len=16", "--data.global_batch_size=4", "--data.micro_batch_size=4", "--data.eval_batches=1",
        f"--data.cache_dir={corpus_cache}", f"--run.out_dir={tmp_path}", "--run.name=fp16", "--run.progress=false",
        "--run.nproc=1", "--optim.warmup_steps=1", "--precision.dtype=fp16", "--precision.init_scale=1024",
        "--checkpoint.save_final=false",
    ])
    trainer = Trainer(cfg, CPU)
    calls = []

    def overflow_on_third_step(module, args, out):
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == 3:
                return out * float("inf")  # gradients become inf/nan on this step only
        return out

    trainer.core.output.register_forward_hook(overflow_on_third_step)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert "step 3: inf/nan gradients, optimizer step skipped; loss scale now 512" in capsys.readouterr().err
    lines = [json.loads(x) for x in (tmp_path / "fp16" / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in lines if r["kind"] == "train"}
    assert [(s, r["skipped_at"], r["skipped_steps"]) for s, r in train.items() if r["skipped_at"]] == [(3, [3], 1)]
    assert train[3]["loss"] is None  # the overflowing step's loss is not finite
    assert all(train[s]["loss"] is not None for s in (4, 5, 6))  # recovered
    assert train[6]["skipped_steps"] == 1 and train[6]["loss_scale"] == 512.0
    assert summary["skipped_steps"] == 1 and summary["val_loss_end"] < summary["val_loss_start"]
