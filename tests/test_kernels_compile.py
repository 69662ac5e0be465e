"""``kernels.compile``: compiled blocks train exactly like eager ones under every family of layout.

1. Trainer: a tiny model with ``kernels.compile=true`` (backend "aot_eager": dynamo and AOT autograd, no C++
   build) has the losses and gradient norms of the uncompiled single-process run (rel 1e-5 / 1e-4 at each of
   3 steps, validation losses) in one process (fp32, and bf16 with LoRA against the same run uncompiled),
   under DDP (dp2) with full activation checkpointing, ZeRO-3, tensor parallelism with sequence parallelism,
   a 1F1B pipeline, context parallelism and expert parallelism (an MoE model); sequence parallelism's
   regions' saved-tensor hooks are kept out of the graphs (traced, they would specialise on a storage address and recompile for every new activation).
   Each rank counts the graphs dynamo compiled by the end of each step: some by the end of step 1 (the
   blocks really ran compiled), none after (no recompilation per step or micro-batch).
2. The default "inductor" backend, once, in one process (a cold compile: slow).
3. Refusals before launch: an unknown backend, compile in the parameter-server job, and compile with selective
   activation checkpointing (its policy cannot see the ops of compiled code: tessera.kernels.apply).
"""

from __future__ import annotations

import pytest
import torch

from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.train.config import load_config, validate_config

from test_trainer import tiny_args
from test_trainer_strategies import assert_like_single_process, metrics, single_process_runs

BASE = ["--checkpoint.save_final=false", "--train.log_every=1", "--train.eval_every=3", "--data.eval_batches=1",
        "--optim.warmup_steps=1"]
COMPILE = ["--kernels.compile=true", "--kernels.compile_backend=aot_eager"]
MOE = ["--model.num_experts=4", "--moe.top_k=2"]
# reference (uncompiled single-process run) → its flags; a layout is compared with the run of its reference
REFERENCES = {"dense": [], "moe": MOE, "bf16-lora": ["--precision.dtype=bf16", "--lora.rank=4"]}
LAYOUTS = {  # name → (world size, reference, flags beyond the reference's)
    "one": (1, "dense", []),
    "bf16-lora": (1, "bf16-lora", []),  # mixed precision and LoRA: compared with the same run uncompiled
    "dp2-recompute": (2, "dense", ["--checkpointing.mode=full"]),
    "zero3": (2, "dense", ["--parallel.dp_shard=2", "--parallel.zero_stage=3"]),
    "tp2-sp": (2, "dense", ["--parallel.tp=2", "--tensor_parallel.sequence_parallel=true"]),
    "pp2": (2, "dense", ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"]),
    "cp2": (2, "dense", ["--parallel.cp=2"]),
    "ep2": (2, "moe", ["--parallel.ep=2"]),
}


def _args(out, cache, reference, extra, steps=3):
    return tiny_args(out, cache, steps=steps, extra=[*BASE, *REFERENCES[reference], *extra])


def compiled_run(rank, world_size, args):
    """One rank of a run (in a fresh dynamo cache: pool workers run many jobs): its summary, plus how many
    graphs dynamo had compiled at the end of each training step."""
    from torch._dynamo.utils import counters

    from tessera.train.trainer import Trainer

    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(load_config(None, args), torch.device("cpu"))
    graphs, train_step = [], trainer._train_step

    def counted(track, **kwargs):
        out = train_step(track, **kwargs)
        graphs.append(counters["stats"]["unique_graphs"])
        return out

    trainer._train_step = counted
    try:
        return {**trainer.fit(), "graphs": graphs}
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """One uncompiled single-process run per key of REFERENCES, made on first use."""
    return single_process_runs(tmp_path_factory.mktemp("reference"),
                               lambda out, key: _args(out, corpus_cache, key, [f"--run.name={key}"]))


def _check(results, single, ref, got, world):
    assert_like_single_process(results, single, ref, got, world)
    for r in results:  # compiled at all (in step 1, or the validation before it); nothing after step 1
        assert r["graphs"][0] > 0 and r["graphs"] == [r["graphs"][0]] * 3, r["graphs"]


@pytest.mark.parametrize("name", [n for n, (world, _, _) in LAYOUTS.items() if world == 1])
def test_compiled_blocks_match_eager_in_one_process(tmp_path, corpus_cache, references, name):
    _, reference, flags = LAYOUTS[name]
    single, ref = references(reference)
    result = compiled_run(0, 1, _args(tmp_path, corpus_cache, reference, [*COMPILE, *flags, f"--run.name={name}"]))
    _check([result], single, ref, metrics(tmp_path / name), 1)


@pytest.mark.multirank
@pytest.mark.parametrize("name", [n for n, (world, _, _) in LAYOUTS.items() if world > 1])
def test_compiled_blocks_match_single_process(rank_pool, tmp_path, corpus_cache, references, name):
    world, reference, flags = LAYOUTS[name]
    single, ref = references(reference)
    args = _args(tmp_path, corpus_cache, reference, [*COMPILE, *flags, f"--run.name={name}"])
    validate_config(load_config(None, args), world)
    results = rank_pool.run(compiled_run, world, args=args, timeout=600.0)
    _check(results, single, ref, metrics(tmp_path / name), world)


@pytest.mark.slow
def test_inductor_compiled_blocks_match_eager(tmp_path, corpus_cache, references):
    """The default backend, in one process: inductor's generated kernels round differently from eager
    (fused reductions), so losses agree to rel 1e-4 rather than the parity tolerance."""
    single, ref = references("dense")
    torch._dynamo.reset()
    args = _args(tmp_path, corpus_cache, "dense", ["--kernels.compile=true", "--run.name=inductor"])
    summary = run_rank(load_config(None, args))
    got = metrics(tmp_path / "inductor")
    for key in ("val_loss_start", "val_loss_end", "train_loss_end"):
        assert summary[key] == pytest.approx(single[key], rel=1e-4), key
    for a, b in zip(ref, got):
        if a["kind"] == "train":
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


@pytest.mark.parametrize("flags,message", [
    (["--kernels.compile_backend=no-such-backend"], "kernels.compile_backend='no-such-backend' is not a torch"),
    (["--model.preset=ctr"], "kernels.compile=True has no effect in this job"),
    (["--checkpointing.mode=selective"], "compiled block's generated code hides them"),
])
def test_compile_refusals(flags, message):
    cfg = load_config(None, ["--kernels.compile=true", *flags])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, 1)
    assert message in str(err.value) and "\n" not in str(err.value)
