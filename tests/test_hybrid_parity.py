"""Hybrid layouts train like one process: the full trainer on 4 and 8 ranks against one process.

Every supported composition of dp_replicate × dp_shard (ZeRO 0–3) × pp × tp (+SP) × cp × ep runs the
same tiny model (4 layers) from the same seed on the same global batches as one process; losses
(rel 1e-5) and gradient norms (rel 1e-4) must agree at every logged step, and the validation losses
too. The table of supported layouts is docs/HYBRID.md; the rejected ones are checked at the end.
"""

import pytest

from tessera.errors import ConfigError
from tessera.train.config import load_config, validate_config

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, assert_tracks_fp32, metrics, single_process_runs

SP = "--tensor_parallel.sequence_parallel=true"
PP = ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"]
MOE = ["--model.num_experts=4", "--moe.top_k=2"]
LAYOUTS = {  # name → (world size, model, extra args)
    "zero1xtp2": (4, "dense", ["--parallel.tp=2", "--parallel.zero_stage=1"]),
    "zero2xtp2-sp": (4, "dense", ["--parallel.tp=2", "--parallel.zero_stage=2", SP]),
    "zero3xtp2": (4, "dense", ["--parallel.tp=2", "--parallel.zero_stage=3"]),
    "pp2xtp2-sp-tied": (4, "tied", ["--parallel.tp=2", SP, *PP]),
    "dp2xpp2xtp2": (8, "dense", ["--parallel.tp=2", *PP]),
    "pp2xtp2-zb-h1": (4, "dense", ["--parallel.tp=2", "--parallel.pp=2", "--pipeline.schedule=zb-h1",
                                         "--pipeline.microbatches=2"]),
    "pp2xtp2-interleaved-sp": (4, "dense", ["--parallel.tp=2", SP, "--parallel.pp=2", "--pipeline.microbatches=4",
                                            "--pipeline.schedule=interleaved", "--pipeline.virtual_stages=2"]),
    "zero1xpp2xtp2-tied": (8, "tied", ["--parallel.tp=2", "--parallel.zero_stage=1", *PP]),
    "dp2xtp2-moe": (4, "moe", ["--parallel.tp=2"]),  # MoE under tp without ep: experts replicated over tp
    "ep2xtp2-sp": (4, "moe", ["--parallel.tp=2", "--parallel.ep=2", SP]),
    "dp4-ep2xtp2": (8, "moe", ["--parallel.tp=2", "--parallel.ep=2"]),
    "zero1xcp2xtp2-sp": (8, "dense", ["--parallel.tp=2", "--parallel.cp=2", "--parallel.zero_stage=1", SP]),
}
MODELS = {
    "dense": ["--model.n_layers=4"],
    "tied": ["--model.n_layers=4", "--model.tie_embeddings=true"],
    "moe": ["--model.n_layers=4", *MOE],
}
COMMON = ["--checkpoint.save_final=false"]


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """One single-process run per model variant, made on first use."""
    return single_process_runs(tmp_path_factory.mktemp("reference"), lambda out, model: tiny_args(
        out, corpus_cache, extra=[*MODELS[model], *COMMON, f"--run.name={model}"]))


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_layout_matches_single_process(rank_pool, tmp_path, corpus_cache, references, name):
    world, model, extra = LAYOUTS[name]
    single, ref = references(model)
    args = tiny_args(tmp_path, corpus_cache, extra=[*MODELS[model], *COMMON, *extra, f"--run.name={name}"])
    validate_config(load_config(None, args), world)  # the layout passes validation before any rank starts
    results = rank_pool.run(trainer_worker, world, args=args, timeout=600.0)
    assert_like_single_process(results, single, ref, metrics(tmp_path / name), world)


SUPPORTED = [  # (world size, args): every one passes validation (those above also train like one process)
    (4, ["--parallel.tp=2", "--parallel.zero_stage=3", SP]),
    (8, ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.zero_stage=2"]),  # hybrid shard × tp
    (8, ["--parallel.tp=2", "--parallel.cp=2", "--parallel.zero_stage=3"]),
    (8, ["--parallel.tp=2", "--parallel.zero_stage=1", *PP]),
    (8, ["--parallel.tp=2", SP, *PP]),
    (8, ["--parallel.tp=2", "--parallel.ep=2", *MOE]),
]
REJECTED = [  # (world size, args, the reason's words): the pairings that cannot work by construction
    (4, ["--parallel.pp=2", "--parallel.zero_stage=3", "--pipeline.schedule=pipedream"],
     "ZeRO-3 with the weight-stashing pipeline.schedule='pipedream'"),
    (4, ["--parallel.pp=2", "--parallel.zero_stage=3", "--pipeline.schedule=2bw"],
     "ZeRO-3 with the weight-stashing pipeline.schedule='2bw'"),
    (2, ["--parallel.pp=2", "--model.tie_embeddings=true", "--pipeline.schedule=pipedream"],
     "tied embeddings with the asynchronous pipedream schedule"),
]
FORMERLY_REJECTED = [  # refused before issue 15; each now trains (tests/test_composition_matrix.py and others)
    (4, ["--parallel.pp=2", "--parallel.zero_stage=2"]),
    (4, ["--parallel.pp=2", "--parallel.cp=2"]),
    (4, ["--parallel.pp=2", *MOE]),
    (4, ["--parallel.pp=2", "--precision.dtype=bf16"]),
    (4, ["--parallel.pp=2", "--parallel.zero_stage=1", "--pipeline.schedule=pipedream"]),
    (4, ["--parallel.pp=2", "--parallel.tp=2", "--pipeline.schedule=2bw"]),
    (4, ["--parallel.ep=2", "--parallel.cp=2", *MOE]),
    (4, ["--parallel.ep=2", "--parallel.zero_stage=3", *MOE]),
    (4, ["--parallel.cp=2", "--precision.dtype=bf16"]),
    (4, ["--parallel.cp=2", *MOE]),
    (4, ["--parallel.tp=4", "--tensor_parallel.mode=2d"]),
]


def _config(args):
    return load_config(None, ["--model.preset=tiny", "--model.n_layers=4", "--data.seq_len=32",
                              "--data.global_batch_size=32", "--data.micro_batch_size=2", *args])


@pytest.mark.parametrize("world, args", SUPPORTED + FORMERLY_REJECTED)
def test_supported_layouts_pass_validation(world, args):
    validate_config(_config(args), world)


@pytest.mark.parametrize("world, args, reason", REJECTED)
def test_unsupported_layouts_are_rejected_with_one_sentence(world, args, reason):
    with pytest.raises(ConfigError, match="cannot be combined") as err:
        validate_config(_config(args), world)
    assert reason in str(err.value) and "\n" not in str(err.value)


@pytest.mark.multirank
def test_bf16_zero1_with_tensor_parallel_tracks_the_fp32_curve(rank_pool, tmp_path, corpus_cache, references):
    """Mixed precision composes with tp: bf16 weights through ZeRO-1 × tp2 stay within test_precision's
    bound of the fp32 single-process losses, yet really differ (computed in bf16)."""
    _, ref = references("dense")
    args = tiny_args(tmp_path, corpus_cache, extra=[*MODELS["dense"], *COMMON, "--parallel.tp=2",
                                                     "--parallel.zero_stage=1", "--precision.dtype=bf16",
                                                     "--run.name=bf16"])
    validate_config(load_config(None, args), 4)
    rank_pool.run(trainer_worker, 4, args=args, timeout=600.0)
    assert_tracks_fp32(ref, metrics(tmp_path / "bf16"), "bf16 ZeRO-1 x tp2")


def test_norm_counts_a_replicated_piece_only_at_coordinate_zero():
    """The rule of tessera.grad_norm on one rank: a piece split along tp always adds its squares, one
    replicated along tp only on tp rank 0 (the all-reduce over tp then counts every element once)."""
    import torch

    from tessera.grad_norm import GradPiece, local_squares

    class Coordinate:  # the only thing local_squares reads from a group
        def __init__(self, rank):
            self.rank = rank

    pieces = [GradPiece(torch.tensor([3.0]), frozenset({"tp"})), GradPiece(torch.tensor([4.0]))]
    cpu = torch.device("cpu")
    assert float(local_squares(pieces, {"tp": Coordinate(0)}, cpu)) == 25.0
    assert float(local_squares(pieces, {"tp": Coordinate(1)}, cpu)) == 9.0
    assert float(local_squares(pieces, {}, cpu)) == 25.0  # no splitting axis: everything counts
