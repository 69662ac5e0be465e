"""Pipeline stages key their MoE routers' noise and mark padding as one process does.

Every pp rank holds the step's micro-batches (inputs and targets), so each stage keys micro-batch j's
tokens by its rows in the run's sample order and marks its padding from its targets, before the forward
and again before the backward (a recomputed forward redraws the same noise). Without a flush, the next
step's early forwards are keyed by the next step's rows.
"""

import numpy as np
import pytest

from tessera.train.config import load_config, validate_config

from test_moe_noise import MOE, POLICY
from test_sft import pairs, prepared, sft_trainer_worker, train_args, train_losses
from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import metrics, single_process_runs

PP = ["--parallel.pp=2", "--pipeline.microbatches=4"]  # pipeline micro-batch: 8 / 4 = data.micro_batch_size


def _args(out, cache, policy, name, extra=()):
    return tiny_args(out, cache, steps=3, extra=[*MOE, *POLICY[policy], f"--run.name={name}", *extra])


def _losses(rows):
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    return single_process_runs(tmp_path_factory.mktemp("pp_noise_ref"),
                               lambda out, policy: _args(out, corpus_cache, policy, policy))


@pytest.mark.multirank
@pytest.mark.parametrize("policy, extra", [("jitter", []), ("rsample", ["--pipeline.recompute=true"])],
                         ids=["jitter", "rsample-recompute"])
def test_pipeline_noisy_gating_matches_single_process(rank_pool, tmp_path, corpus_cache, references, policy, extra):
    """pp2 (1f1b; rsample with each stage's forward recomputed in its backward): the 3 training losses and
    the validation losses equal one process's, and the noise acts (they differ from the noiseless run's)."""
    single, ref = references(policy)
    assert _losses(ref)[0] != pytest.approx(_losses(references("none")[1])[0], rel=1e-6)
    args = _args(tmp_path, corpus_cache, policy, "pp", [*PP, *extra])
    validate_config(load_config(None, args), 2)
    results = rank_pool.run(trainer_worker, 2, args=args, timeout=600.0)
    got = _losses(metrics(tmp_path / "pp"))
    assert len(got) == 3 and got == pytest.approx(_losses(ref), rel=1e-6, abs=0)
    for key in ("val_loss_start", "val_loss_end"):
        assert results[0][key] == pytest.approx(single[key], rel=1e-5), key


@pytest.mark.multirank
def test_2bw_without_a_flush_keys_the_early_forwards_by_the_next_step(rank_pool, tmp_path, corpus_cache):
    """2BW's losses do not depend on the flush; with jitter they still do not, so the next step's
    forwards run early in this step's cool-down drew the next step's rows' noise."""
    base = ["--parallel.pp=2", "--pipeline.schedule=2bw", "--pipeline.microbatches=2"]
    got = {}
    for flush in ("true", "false"):
        args = _args(tmp_path, corpus_cache, "jitter", f"f{flush}", [*base, f"--pipeline.flush={flush}"])
        rank_pool.run(trainer_worker, 2, args=args, timeout=600.0)
        got[flush] = _losses(metrics(tmp_path / f"f{flush}"))
    assert len(got["true"]) == 3 and got["false"] == pytest.approx(got["true"], rel=1e-6, abs=0)


PADDED = [*MOE, "--data.micro_batch_size=2", "--data.bucketing=length", "--moe.noisy_gate_policy=rsample"]


@pytest.mark.multirank
def test_padded_moe_fine_tuning_under_a_pipeline_matches_single_process(rank_pool, tmp_path):
    """Bucketed fine-tuning rows (prompts, padding) with noisy routing: pp2 padded to multiples of 2 trains
    as one process padded to multiples of 8 (4 losses, validation), so every stage leaves padding out."""
    from tessera.launch import run_rank

    data = prepared(tmp_path, "sft", pairs(40), val_fraction=0.25)[1]
    single = run_rank(load_config(None, train_args(tmp_path, data, "one", extra=[*PADDED, "--data.bucket_multiple=8"])))
    args = train_args(tmp_path, data, "pp", extra=[*PADDED, "--data.bucket_multiple=2", "--parallel.pp=2",
                                                   "--pipeline.microbatches=2"])
    validate_config(load_config(None, args), 2)
    results = rank_pool.run(sft_trainer_worker, 2, args=args, timeout=600.0)
    want, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "pp")
    assert len(want) == 4 and np.allclose(got, want, rtol=1e-5, atol=0), (want, got)
    for key in ("val_loss_start", "val_loss_end"):
        assert results[0][key] == pytest.approx(single[key], rel=1e-5), key
