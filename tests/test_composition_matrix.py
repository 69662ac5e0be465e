"""Every strategy with every other: the composition matrix, trained by the real trainer.

Every pair of {dp, ZeRO-1, ZeRO-2, ZeRO-3, pp, tp, tp+sp, cp, ep, activation checkpointing, bf16} (the
ZeRO stages are one axis, so they do not pair with each other, nor tp with tp+sp), plus pp×tp×{ZeRO-1, cp,
ep}, dp×pp×tp×bf16×selective recompute, the zero-bubble schedule with ZeRO and with tp+SP×cp, and pp×ep
with cp, with edp 2, and with ZeRO-3 and tied embeddings, runs the full trainer on 2, 4 or 8 ranks (the
smallest world that holds the combination) from the same seed on the same global batches as one process.
fp32 layouts must equal one process (losses rel 1e-5 and gradient norms rel 1e-4 at each of 4 steps,
validation losses too); bf16 layouts must track the fp32 one-process curve within the bound of
tests/test_precision.py::test_low_precision_tracks_the_fp32_loss_curve, yet differ from it (computed in
bf16). docs/HYBRID.md is the table of the same pairs.
"""

from __future__ import annotations

import itertools

import pytest

from tessera.train.config import load_config, validate_config

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, assert_tracks_fp32, metrics, single_process_runs

SP = "--tensor_parallel.sequence_parallel=true"
# name → (grid degrees it adds, extra flags); "moe" marks the items that need a mixture-of-experts model
ITEMS = {
    "dp": ({"dp_replicate": 2}, []),
    "zero1": ({"dp_shard": 2}, ["--parallel.zero_stage=1"]),
    "zero2": ({"dp_shard": 2}, ["--parallel.zero_stage=2"]),
    "zero3": ({"dp_shard": 2}, ["--parallel.zero_stage=3"]),
    "pp": ({"pp": 2}, ["--parallel.pp=2", "--pipeline.schedule=1f1b"]),
    "tp": ({"tp": 2}, ["--parallel.tp=2"]),
    "tp+sp": ({"tp": 2}, ["--parallel.tp=2", SP]),
    "cp": ({"cp": 2}, ["--parallel.cp=2"]),
    "ep": ({"ep": 2}, ["--parallel.ep=2"]),
    "ckpt": ({}, ["--checkpointing.mode=selective"]),
    "bf16": ({}, ["--precision.dtype=bf16"]),
    "zb": ({"pp": 2}, ["--parallel.pp=2", "--pipeline.schedule=zb-h1"]),  # only in EXTRA: zero-bubble pp
    "tied": ({}, []),  # only in EXTRA: tied embeddings (the model's flag)
}
EXCLUSIVE = [{"zero1", "zero2", "zero3"}, {"tp", "tp+sp"}]  # one axis: no pair within a set
MOE = ["--model.num_experts=4", "--moe.top_k=2"]
BASE = ["--model.n_layers=2", "--checkpoint.save_final=false", "--train.steps=4", "--train.log_every=1",
        "--train.eval_every=4", "--data.eval_batches=1"]
GLOBAL_BATCH, MICRO_BATCH = 8, 2


def layout(names: tuple[str, ...]) -> tuple[int, list[str], str]:
    """(world size, flags, model) for a combination of items. ep is carved out of the data-parallel ranks,
    so it brings dp 2 when no data-parallel item does, and doubles the data-parallel degree when one does
    (so experts have edp copies to reduce over); a combination with no multi-rank axis runs on dp 2."""
    degrees = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}
    flags: list[str] = []
    for n in names:
        for axis, d in ITEMS[n][0].items():
            degrees[axis] *= d
        flags += ITEMS[n][1]
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    if degrees["ep"] > 1:
        if dp == 1:
            degrees["dp_replicate"] = 2
        else:
            degrees["dp_shard" if degrees["dp_shard"] > 1 else "dp_replicate"] *= 2
    world = degrees["pp"] * degrees["dp_replicate"] * degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
    if world == 1:
        degrees["dp_replicate"], world = 2, 2
    flags += [f"--parallel.dp_replicate={degrees['dp_replicate']}", f"--parallel.dp_shard={degrees['dp_shard']}"]
    if degrees["pp"] > 1:  # the pipeline's micro-batches are the sampler's: same routing groups as one process
        rank_batch = GLOBAL_BATCH // (degrees["dp_replicate"] * degrees["dp_shard"])
        flags.append(f"--pipeline.microbatches={rank_batch // MICRO_BATCH}")
    return world, flags, ("moe" if "ep" in names else "dense") + ("-tied" if "tied" in names else "")


PAIRS = [p for p in itertools.combinations([i for i in ITEMS if i not in ("zb", "tied")], 2)
         if not any(set(p) <= s for s in EXCLUSIVE)]
TRIPLES = [("pp", "tp", "zero1"), ("pp", "tp", "cp"), ("pp", "tp", "ep"), ("dp", "pp", "tp", "bf16", "ckpt")]
EXTRA = [("zb", "zero1"), ("zb", "zero3"), ("zb", "tp+sp", "cp"),  # zero-bubble's deferred weight gradients
         # pp × ep: experts reduced over edp × cp, over edp 2, and stage 0 without experts under ZeRO
         ("pp", "ep", "cp"), ("dp", "pp", "ep"), ("pp", "ep", "zero1"), ("pp", "ep", "zero3", "tied")]
CASES = {"x".join(c): c for c in PAIRS + TRIPLES + EXTRA}


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """One fp32 single-process run per model, made on first use."""
    return single_process_runs(tmp_path_factory.mktemp("reference"),
                               lambda out, model: _args(out, corpus_cache, model, [f"--run.name={model}"]))


def _args(out, cache, model, extra):
    tied = ["--model.tie_embeddings=true"] if model.endswith("-tied") else []
    args = tiny_args(out, cache, extra=[*BASE, *(MOE if model.startswith("moe") else []), *tied, *extra])
    return [*args, f"--data.global_batch_size={GLOBAL_BATCH}", f"--data.micro_batch_size={MICRO_BATCH}"]


def test_the_matrix_holds_every_pair():
    assert len(PAIRS) == 55 - 4  # 11 items; the three ZeRO pairs and tp × tp+sp share an axis
    assert {w for w, _, _ in map(layout, CASES.values())} == {2, 4, 8}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(CASES))
def test_composition_trains_like_one_process(rank_pool, tmp_path, corpus_cache, references, name):
    world, flags, model = layout(CASES[name])
    single, ref = references(model)
    args = _args(tmp_path, corpus_cache, model, [*flags, f"--run.name={name}"])
    validate_config(load_config(None, args), world)  # passes validation before any rank starts
    results = rank_pool.run(trainer_worker, world, args=args, timeout=600.0)
    got = metrics(tmp_path / name)
    if "bf16" not in CASES[name]:
        assert_like_single_process(results, single, ref, got, world)
        return
    assert_tracks_fp32(ref, got, f"{name} ({world} ranks)", min_logs=4)
