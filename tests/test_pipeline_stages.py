"""Model-side strategies inside pipeline stages train like one process: activation checkpointing,
mixture-of-experts (routing losses of every stage), expert parallelism and context parallelism, each
applied to a stage by the same function as to a whole model (``parallelize_model_side``).

Every layout runs the full trainer on the rank pool with the same tiny 4-layer model, seed and global
batches as one process; losses (rel 1e-5) and gradient norms (rel 1e-4) agree at every logged step.
"""

import pytest

from tessera.train.config import load_config, validate_config

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, metrics, single_process_runs

SP = "--tensor_parallel.sequence_parallel=true"
PP = ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"]
# a pipeline micro-batch is a routing group: as in one process, data.micro_batch_size=2 sequences
PP4 = ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=4"]
# strong routing losses, so a stage whose auxiliary losses missed the gradient would change the curve
MOE = ["--model.num_experts=4", "--moe.top_k=2", "--moe.aux_loss_coef=1.0", "--moe.z_loss_coef=0.1"]
MODELS = {"dense": ["--model.n_layers=4"], "moe": ["--model.n_layers=4", *MOE]}
COMMON = ["--checkpoint.save_final=false"]
LAYOUTS = {  # name → (world size, model, extra args)
    "pp2-full": (2, "dense", [*PP, "--checkpointing.mode=full"]),
    "pp2-selective-every2": (2, "dense", [*PP, "--checkpointing.mode=selective", "--checkpointing.every=2"]),
    # block checkpoints inside stages that pipeline.recompute re-materialises as a whole (nested)
    "pp2-recompute-selective": (2, "dense", [*PP, "--pipeline.recompute=true", "--checkpointing.mode=selective"]),
    "dp2xpp2-moe": (4, "moe", PP),
    "pp2xep2": (4, "moe", [*PP, "--parallel.ep=2"]),  # all-to-all over ep inside each stage
    "pp2-moe-zb-h1": (2, "moe", [*PP4, "--pipeline.schedule=zb-h1"]),  # weight gradients deferred
    "pp2-moe-interleaved": (2, "moe", [*PP4, "--pipeline.schedule=interleaved", "--pipeline.virtual_stages=2"]),
    "pp2xcp2": (4, "dense", [*PP, "--parallel.cp=2"]),
    "pp2xtp2-sp-moe-selective": (4, "moe", [*PP4, "--parallel.tp=2", SP, "--checkpointing.mode=selective"]),
    "pp2xtp2-spxcp2": (8, "dense", [*PP, "--parallel.tp=2", SP, "--parallel.cp=2"]),
}

# the strategy really runs inside the stages: its collectives are in rank 0's comm ledger
COMM = {"pp2xep2": "ep/all_to_all", "pp2xcp2": "cp/", "pp2xtp2-spxcp2": "cp/"}


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """One single-process run per model variant, made on first use."""
    return single_process_runs(tmp_path_factory.mktemp("reference"), lambda out, model: tiny_args(
        out, corpus_cache, extra=[*MODELS[model], *COMMON, f"--run.name={model}"]))


def _train(rank_pool, tmp_path, corpus_cache, world, model, extra, name, steps=6):
    args = tiny_args(tmp_path, corpus_cache, steps=steps,
                     extra=[*MODELS[model], *COMMON, *extra, f"--run.name={name}"])
    validate_config(load_config(None, args), world)  # the layout passes validation before any rank starts
    return rank_pool.run(trainer_worker, world, args=args, timeout=600.0), metrics(tmp_path / name)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_stage_strategies_match_single_process(rank_pool, tmp_path, corpus_cache, references, name):
    world, model, extra = LAYOUTS[name]
    single, ref = references(model)
    results, got = _train(rank_pool, tmp_path, corpus_cache, world, model, extra, name)
    assert_like_single_process(results, single, ref, got, world)
    if name in COMM:
        train = next(r for r in got if r["kind"] == "train")
        assert any(key.startswith(COMM[name]) for key in train["comm_per_step"]), train["comm_per_step"]


@pytest.mark.multirank
def test_checkpointing_inside_stages_keeps_fewer_activations(rank_pool, tmp_path, corpus_cache):
    """[checkpointing] really acts inside the stages: each pp rank holds fewer saved activations with
    selective recomputation than without, and fewer still with full recomputation."""
    held = {}
    for mode in ("none", "selective", "full"):
        _, got = _train(rank_pool, tmp_path, corpus_cache, 2, "dense", [*PP, f"--checkpointing.mode={mode}"],
                        mode, steps=2)
        held[mode] = [m["activations"] for m in next(r for r in got if r["kind"] == "train")["memory"]]
    for rank in range(2):
        assert held["full"][rank] < held["selective"][rank] < held["none"][rank], held


def moe_metrics_worker(rank, world_size, args):
    """One optimizer step of the trainer, then the routing metrics of the whole model."""
    import torch

    from tessera.moe import moe_metrics
    from tessera.train.trainer import Trainer

    trainer = Trainer(load_config(None, args), torch.device("cpu"))
    try:
        trainer._train_step(track=False)
        return moe_metrics(trainer.core, [trainer.topology.group("pp"), trainer.tokens_group], trainer.cfg.model)
    finally:
        trainer.close()


@pytest.mark.multirank
def test_pipeline_moe_metrics_cover_every_stage(rank_pool, tmp_path, corpus_cache):
    """Routing counters of all stages' MoE layers, summed over pp and dp, are what one process reports."""
    args = tiny_args(tmp_path, corpus_cache, extra=[*MODELS["moe"], *COMMON, "--run.name=metrics"])
    single = moe_metrics_worker(0, 1, args)
    got = rank_pool.run(moe_metrics_worker, 4, args=[*args, *PP], timeout=600.0)
    assert len(single["moe_load_per_layer"]) == 2  # blocks 1 and 3 (model.moe_every=2), one per stage
    for metrics_of_rank in got:
        assert metrics_of_rank["moe_tokens_per_expert"] == single["moe_tokens_per_expert"]
        assert metrics_of_rank["moe_load_per_layer"] == single["moe_load_per_layer"]  # exact counts
        for key in ("moe_dropped_frac", "moe_aux_loss", "moe_z_loss"):
            assert metrics_of_rank[key] == pytest.approx(single[key], rel=1e-5), key
