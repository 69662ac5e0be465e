"""2D, 2.5D and 3D tensor parallelism train the whole model from the trainer like one process.

Each layout trains the tiny model (embedding, norms, attention, MLP, head, vocabulary-parallel loss,
AdamW, clipping by the job-wide norm) with the full trainer on the rank pool; every logged loss (rel 1e-5)
and gradient norm (rel 1e-4) must equal one process's. Every rank's checkpoint pieces must cover each
element of every single-process tensor exactly once (no replicas inside the grid) and match one process's
state. The final checkpoint of 2D, 2.5D and 3D then loads at 1D tp2 and at one process with identical
weights and the same validation loss. Also: 2D under full recomputation (parity), under bf16 (tracks the
fp32 curve) and on the emulated accelerator. Shapes and pairings a grid cannot take fail validation with
one sentence.
"""

from __future__ import annotations

import pytest
import torch

from tessera.checkpoint.state import state_pieces
from tessera.errors import ConfigError
from tessera.train.config import load_config, validate_config

from test_checkpoint_state import assemble, cloned, compare, engine_of, load_worker, train
from test_device_check import emulated_trainer, trainer_args
from test_trainer import tiny_args
from test_trainer_strategies import assert_like_single_process, metrics

STEPS = 4
# 2 micro-batches of 4 per step (tiny_args has 4 of 2): a grid's step is hundreds of latency-bound
# collectives, and 2 still accumulate; at dp 2 each rank runs one
COMMON = [f"--train.steps={STEPS}", "--train.log_every=1", "--train.eval_every=100", "--data.micro_batch_size=4"]
ND = {"2d": ["--tensor_parallel.mode=2d"], "2.5d": ["--tensor_parallel.mode=2.5d", "--tensor_parallel.depth=2"],
      "3d": ["--tensor_parallel.mode=3d"]}
LAYOUTS = {  # name → (world size, extra args)
    "2d": (4, ["--parallel.tp=4", *ND["2d"]]),
    "2.5d": (8, ["--parallel.tp=8", *ND["2.5d"]]),
    "3d": (8, ["--parallel.tp=8", *ND["3d"]]),
    "dp2x2d": (8, ["--parallel.tp=4", *ND["2d"]]),
    "zero1xdp2x2d": (8, ["--parallel.tp=4", "--parallel.zero_stage=1", *ND["2d"]]),
    "zero3xdp2x2d": (8, ["--parallel.tp=4", "--parallel.zero_stage=3", *ND["2d"]]),  # gathers through the grid
    "2d-recompute": (4, ["--parallel.tp=4", *ND["2d"], "--checkpointing.mode=full"]),
    "2d-bf16": (4, ["--parallel.tp=4", *ND["2d"], "--precision.dtype=bf16"]),  # fp32 masters, bf16 compute
}
FP32 = [name for name in LAYOUTS if "bf16" not in name]
RELOADED = ("2d", "2.5d", "3d")  # their final checkpoints load at 1D tp2 and at one process


def nd_worker(rank, world_size, args):
    """Train; return the summary and this rank's checkpoint pieces (model and AdamW state)."""
    trainer = train(args)
    try:
        pieces = cloned(state_pieces(trainer.core, trainer.optimizer, trainer.topology, engine_of(trainer)))
        return trainer.summary, pieces
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache):
    """One process: its summary, metrics and final state (read from its checkpoint pieces)."""
    out = tmp_path_factory.mktemp("reference")
    summary, pieces = nd_worker(0, 1, tiny_args(out, corpus_cache, steps=STEPS, extra=[*COMMON, "--run.name=ref"]))
    return summary, metrics(out / "ref"), assemble([pieces])


@pytest.fixture(scope="module")
def trained(rank_pool, tmp_path_factory, corpus_cache):
    """Each layout's run, made on first use: (folder, per-rank summaries, assembled state)."""
    done = {}

    def get(name):
        if name not in done:
            world, extra = LAYOUTS[name]
            out = tmp_path_factory.mktemp(name.replace(".", "p"))
            args = tiny_args(out, corpus_cache, steps=STEPS, extra=[*COMMON, *extra, f"--run.name={name}"])
            validate_config(load_config(None, args), world)  # passes validation before any rank starts
            results = rank_pool.run(nd_worker, world, args=args, timeout=900.0)
            done[name] = (out / name, [s for s, _ in results], assemble([p for _, p in results]))
        return done[name]

    return get


@pytest.mark.multirank
@pytest.mark.parametrize("name", FP32)
def test_nd_tensor_parallel_matches_single_process(reference, trained, name):
    single, ref, ref_state = reference
    run, results, state = trained(name)
    world = LAYOUTS[name][0]
    assert results[0]["layout"].startswith(f"{world} rank(s)") and "tp=" in results[0]["layout"]
    assert_like_single_process(results, single, ref, metrics(run), world)
    assert len([r for r in metrics(run) if r["kind"] == "train"]) == STEPS
    compare(state, ref_state)  # assemble() checked: every element held, replicas only across dp


@pytest.mark.multirank
def test_nd_bf16_tracks_the_fp32_loss_curve(reference, trained):
    """bf16 compute over fp32 master weights on the 2D grid stays within test_precision's bound of the
    fp32 single-process losses, yet really differs from them."""
    _, ref, _ = reference
    run, _, _ = trained("2d-bf16")
    want = [r["loss"] for r in ref if r["kind"] == "train"]
    got = [r["loss"] for r in metrics(run) if r["kind"] == "train"]
    diff = max(abs(a - b) for a, b in zip(want, got))
    assert len(got) == STEPS and got[-1] < got[0] - 0.1  # it learns
    assert 0 < diff < 0.01


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["2d", "3d"])
def test_nd_ranks_hold_each_element_once(trained, name):
    """Inside one grid no parameter element is replicated: the ranks' model pieces are disjoint and add
    up to the single-process parameter count."""
    _, results, state = trained(name)
    held = sum(m["params"] for m in results[0]["memory_per_rank"]) // 4  # fp32 bytes over every rank
    assert held == results[0]["parameters"]


@pytest.mark.multirank
@pytest.mark.parametrize("name", RELOADED)
@pytest.mark.parametrize("target", ["tp2", "one"])
def test_nd_checkpoint_reloads_at_1d_tp2_and_one_process(rank_pool, tmp_path, corpus_cache, trained, name, target):
    run, results, state = trained(name)
    path = run / "checkpoint" / f"step_{STEPS:06d}"
    args = tiny_args(tmp_path, corpus_cache, steps=STEPS, extra=[*COMMON, f"--run.name={target}"]
                     + (["--parallel.tp=2"] if target == "tp2" else []))
    if target == "one":
        loaded = [load_worker(0, 1, args, str(path))]
    else:
        loaded = rank_pool.run(load_worker, 2, args=args, path=str(path), timeout=300.0)
    got = assemble([pieces for pieces, _, _ in loaded])
    assert sorted(got) == sorted(state)
    for key, value in state.items():
        assert torch.equal(got[key], value), key
    assert loaded[0][1]["step"] == STEPS
    assert loaded[0][2] == pytest.approx(results[0]["val_loss_end"], rel=1e-5)


def _config(world, args):
    cfg = load_config(None, ["--model.preset=tiny", "--data.seq_len=32", "--data.global_batch_size=8",
                             "--data.micro_batch_size=1", *args])
    return validate_config(cfg, world)


@pytest.mark.parametrize("world, args", [
    (4, ["--model.preset=small", "--model.n_layers=2", "--parallel.tp=4", *ND["2d"]]),
    (8, ["--parallel.tp=8", *ND["2.5d"]]),
    (8, ["--parallel.tp=8", *ND["3d"]]),
])
def test_the_cli_layouts_pass_validation(world, args):
    _config(world, args)


@pytest.mark.parametrize("world, args, words", [
    (8, ["--parallel.tp=8", *ND["2d"]], "square q×q"),
    (4, ["--parallel.tp=4", *ND["3d"]], "must be a cube"),
    (8, ["--parallel.tp=8", "--tensor_parallel.mode=2.5d", "--tensor_parallel.depth=3"], "with depth=3"),
    (8, ["--parallel.tp=8", *ND["3d"], "--model.ffn_hidden_dim=66"], "ffn_hidden_dim (66) to be divisible by 4"),
    (4, ["--parallel.tp=4", *ND["2d"], "--model.vocab_size=257"], "vocab_size (257) to be divisible by 2"),
    (4, ["--parallel.tp=4", *ND["2d"], "--model.n_heads=2", "--model.n_kv_heads=1"], "n_kv_heads (1)"),
    (4, ["--parallel.tp=4", *ND["2d"], "--tensor_parallel.sequence_parallel=true"], "sequence parallelism"),
    (4, ["--parallel.tp=4", *ND["2d"], "--model.tie_embeddings=true"], "tie_embeddings=false"),
    (4, ["--parallel.tp=4", *ND["2d"], "--model.dropout=0.1"], "no dropout"),
    (8, ["--parallel.tp=4", *ND["2d"], "--parallel.cp=2"], "context parallelism"),
    (8, ["--parallel.tp=4", *ND["2d"], "--model.num_experts=4", "--parallel.ep=2"], "mixture-of-experts"),
])
def test_shapes_and_pairings_a_grid_cannot_split_fail_with_one_sentence(world, args, words):
    with pytest.raises(ConfigError) as err:
        _config(world, args)
    assert words in str(err.value) and "\n" not in str(err.value)



@pytest.mark.multirank
def test_nd_trainer_keeps_collective_tensors_on_the_device(rank_pool, tmp_path, corpus_cache):
    """One 2D step under the emulated accelerator: the grid's, the loss's and the tokens' collectives
    (grid groups, the tp partition, the token count) get no host tensor."""
    args = trainer_args(tmp_path, corpus_cache, "2d-device",
                        ["--parallel.tp=4", *ND["2d"], "--data.micro_batch_size=4"])
    results = rank_pool.run(emulated_trainer, 4, args=args)
    assert all(r["groups"] == {"cpu:0"} for r in results) and "tp=4" in results[0]["layout"]
