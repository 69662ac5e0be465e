"""The trainer under tensor, context, pipeline and expert parallelism: N ranks train like one process.

Each layout runs the full trainer (sampler, token weighting, the strategy, clipping, validation) on the
rank pool and is compared with one process on the same global batches: losses and gradient norms at
every logged step, and the validation losses.
"""

import json

import pytest

from tessera.launch import run_rank
from tessera.train.config import load_config

from test_trainer import tiny_args, trainer_worker

LAYOUTS = {
    "tp2": (2, ["--parallel.tp=2"]),
    "tp2-sp": (2, ["--parallel.tp=2", "--tensor_parallel.sequence_parallel=true"]),
    "tp2xcp2-ring": (4, ["--parallel.tp=2", "--parallel.cp=2"]),
    "dp2xcp2-ulysses": (4, ["--parallel.cp=2", "--context_parallel.method=ulysses"]),
    "dp2xpp2-1f1b": (4, ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"]),
    "pp2-interleaved": (2, ["--parallel.pp=2", "--pipeline.schedule=interleaved", "--pipeline.microbatches=4",
                            "--pipeline.virtual_stages=2"]),
    "dp2xtp2xcp2-sp": (8, ["--parallel.tp=2", "--parallel.cp=2", "--tensor_parallel.sequence_parallel=true"]),
}
MODEL = ["--model.n_layers=4", "--checkpoint.save_final=false"]


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


LOW_PRECISION_BOUND = 0.01  # tests/test_precision.py's bound on the largest loss difference from fp32


def assert_tracks_fp32(ref, got, label: str, min_logs: int = 1) -> float:
    """A low-precision run's metrics records ``got`` against the fp32 one-process ``ref``: the same logged
    steps, and the largest loss difference below LOW_PRECISION_BOUND yet above 0 (really computed in low
    precision). Returns that difference."""
    want = [r["loss"] for r in ref if r["kind"] == "train"]
    have = [r["loss"] for r in got if r["kind"] == "train"]
    diff = max(abs(a - b) for a, b in zip(want, have))
    print(f"\n{label} vs fp32 one process: largest loss difference {diff:.4f} over {len(have)} logs")
    assert len(have) == len(want) >= min_logs and 0 < diff < LOW_PRECISION_BOUND
    return diff


def single_process_runs(out, args_of):
    """``get(key) -> (summary, metrics records)``: one single-process run per key, made on first use in
    folder ``out``; ``args_of(out, key)`` is the run's argument list, whose ``--run.name`` is ``key``."""
    done = {}

    def get(key):
        if key not in done:
            done[key] = (run_rank(load_config(None, args_of(out, key))), metrics(out / key))
        return done[key]

    return get


def assert_like_single_process(results, single, ref, got, world):
    """Every rank's summary and every logged step of an N-rank run equal the single-process run's (fp32:
    losses within rel 1e-5, gradient norms within rel 1e-4)."""
    assert len({r["val_loss_end"] for r in results}) == 1  # every rank reports the same loss
    for key in ("val_loss_start", "val_loss_end", "train_loss_end"):
        assert results[0][key] == pytest.approx(single[key], rel=1e-5), key
    assert [r["kind"] for r in got] == [r["kind"] for r in ref]
    for a, b in zip(ref, got):
        if a["kind"] == "train":
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
            assert len(b["memory"]) == world


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache):
    out = tmp_path_factory.mktemp("reference")
    summary = run_rank(load_config(None, tiny_args(out, corpus_cache, extra=[*MODEL, "--run.name=ref"])))
    return summary, metrics(out / "ref")


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trainer_layout_matches_single_process(rank_pool, tmp_path, corpus_cache, reference, name):
    world, extra = LAYOUTS[name]
    single, ref = reference
    args = tiny_args(tmp_path, corpus_cache, extra=[*MODEL, *extra, f"--run.name={name}"])
    results = rank_pool.run(trainer_worker, world, args=args)
    assert_like_single_process(results, single, ref, metrics(tmp_path / name), world)
    if "pp" in name:  # the pipeline leaves its timeline in the run folder
        assert (tmp_path / name / "timeline.png").exists() and (tmp_path / name / "trace.json").exists()
        assert 0 < results[0]["bubble_fraction"] < 1


@pytest.mark.multirank
def test_trainer_runs_expert_parallel_moe_and_logs_routing(rank_pool, tmp_path, corpus_cache):
    args = tiny_args(tmp_path, corpus_cache, steps=4, extra=[
        "--model.num_experts=4", "--parallel.ep=2", "--moe.top_k=2", "--run.name=moe", "--checkpoint.save_final=false"])
    results = rank_pool.run(trainer_worker, 2, args=args)
    assert results[0]["val_loss_end"] == results[1]["val_loss_end"] < results[0]["val_loss_start"]
    train = [r for r in metrics(tmp_path / "moe") if r["kind"] == "train"]
    assert {"moe_tokens_per_expert", "moe_dropped_frac", "moe_aux_loss"} <= set(train[-1])
    assert len(train[-1]["moe_tokens_per_expert"]) == 4
    assert any(key.startswith("ep/") for key in train[-1]["comm_per_step"])
