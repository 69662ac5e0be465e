"""TensorBoard event files beside metrics.jsonl (run.tensorboard) and flops_per_s / mfu in every train line."""

import json

import pytest
import torch

from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.planner.catalog import GPUS, from_model_config
from tessera.planner.flops import model_flops
from tessera.observe import tensorboard
from tessera.train.config import load_config, validate_config
from tessera.observe.mfu import ModelFlops, catalogue_peak
from tessera.observe.tensorboard import TensorBoardWriter, scalars

PEAK = 1e10  # run.peak_flops given in the run below: a CPU has no catalogue peak


def tiny_args(out_dir, cache, name, extra=()):
    return ["--model.preset=tiny", "--train.steps=20", "--train.log_every=5", "--train.eval_every=10",
            "--data.seq_len=32", "--data.global_batch_size=4", "--data.micro_batch_size=2",
            "--data.eval_batches=1", f"--data.cache_dir={cache}", f"--run.out_dir={out_dir}",
            f"--run.name={name}", "--run.progress=false", "--checkpoint.save_final=false", *extra]


def read_events(folder) -> dict:
    """{tag: {step: value}} of every scalar in an event folder, as TensorBoard reads it (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def trainer_worker(rank, world_size, args):
    return run_rank(load_config(None, args))


def test_catalogue_peak_by_driver_name():
    assert catalogue_peak("NVIDIA H100 80GB HBM3") == GPUS["h100"].peak_flops
    assert catalogue_peak("NVIDIA H200") == GPUS["h200"].peak_flops
    assert catalogue_peak("NVIDIA A100-SXM4-40GB") == GPUS["a100-40gb"].peak_flops
    assert catalogue_peak("NVIDIA A100-SXM4-80GB") == GPUS["a100-80gb"].peak_flops
    assert catalogue_peak("NVIDIA GeForce RTX 3090") is None


def test_model_flops_on_a_cpu_without_a_peak_is_null_and_lora_counts_fewer(tmp_path):
    cfg = load_config(None, tiny_args(tmp_path, tmp_path, "x"))
    flops = ModelFlops(cfg, torch.device("cpu"), world_size=2)
    assert flops.per_token == model_flops(from_model_config("t", cfg.model), 1.0, 32)
    assert flops.fields(1000.0) == {"flops_per_s": flops.per_token * 500.0, "mfu": None}
    lora = ModelFlops(load_config(None, tiny_args(tmp_path, tmp_path, "x", ["--lora.rank=2"])),
                      torch.device("cpu"), world_size=2)
    assert 0 < lora.per_token < flops.per_token  # frozen weights need no weight gradient


def test_tensorboard_missing_is_refused_before_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorboard.importlib.util, "find_spec", lambda name: None)
    cfg = load_config(None, tiny_args(tmp_path, tmp_path, "x", ["--run.tensorboard=true"]))
    with pytest.raises(ConfigError, match=r"tessera\[tensorboard\]"):
        validate_config(cfg, 1)
    with pytest.raises(ConfigError, match="run.peak_flops"):
        validate_config(load_config(None, tiny_args(tmp_path, tmp_path, "x", ["--run.peak_flops=-1"])), 1)


def test_a_resumed_writer_replaces_the_steps_after_its_first_line(tmp_path):
    """A restarted run logs again from step 3: TensorBoard shows steps 1-4 once, 3 and 4 the new values."""
    first = TensorBoardWriter(tmp_path)
    for step in (1, 2, 3, 4):
        first.log({"kind": "train", "step": step, "loss": float(step)})
    first.close()
    again = TensorBoardWriter(tmp_path)
    for step in (3, 4):
        again.log({"kind": "train", "step": step, "loss": 10.0 * step})
    again.close()
    assert read_events(tmp_path / "tensorboard")["loss"] == {1: 1.0, 2: 2.0, 3: 30.0, 4: 40.0}


@pytest.mark.multirank
def test_tensorboard_events_match_metrics_jsonl_with_mfu(rank_pool, tmp_path, corpus_cache):
    """20 steps of DDP on 2 ranks: every number of every metrics line is a TensorBoard scalar at its step,
    and flops_per_s / mfu follow from tokens_per_s."""
    args = tiny_args(tmp_path, corpus_cache, "tb", ["--run.tensorboard=true", f"--run.peak_flops={PEAK}"])
    rank_pool.run(trainer_worker, 2, args=args)
    run = tmp_path / "tb"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    events = read_events(run / "tensorboard")
    per_token = ModelFlops(load_config(None, args), torch.device("cpu"), 2).per_token
    for record in lines:
        expected = scalars(record)
        assert expected, record
        for tag, value in expected.items():
            assert events[tag][record["step"]] == pytest.approx(value, rel=1e-6), tag
    for record in train:
        assert record["flops_per_s"] == pytest.approx(per_token * record["tokens_per_s"] / 2)
        assert record["mfu"] == pytest.approx(record["flops_per_s"] / PEAK)
        assert {"loss", "lr", "tokens_per_s", "grad_norm", "mfu", "memory/rank1/params"} <= set(scalars(record))
        assert any(tag.startswith("comm_bytes/") for tag in scalars(record))  # DDP's gradient all-reduce
    assert set(events["val_loss"]) == {0, 10, 20}
