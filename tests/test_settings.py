"""Every accepted setting changes what happens, or is refused with one sentence before any rank starts
(tessera.train.settings, tessera.composition; docs/CONFIG.md "Settings that take effect")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.cli import DEMO_LAYOUT, main, resolve_job
from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.train.config import config_dict, load_config, save_config, validate_config

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, metrics

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model.preset=tiny", "--data.seq_len=32", "--data.global_batch_size=8", "--data.micro_batch_size=2"]
AUTO = ["--parallel.auto=true", "--data.micro_batch_size=4"]  # TINY's micro-batch is auto's to choose
MOE = ["--model.num_experts=4"]

# (world, args, the key refused, what its sentence says) — each key set where the job would not use it
REFUSED = [
    (1, ["--pipeline.schedule=gpipe"], "pipeline.schedule", "parallel.pp=1"),
    (2, ["--pipeline.microbatches=2"], "pipeline.microbatches", "parallel.pp=1"),
    (2, ["--parallel.pp=2", "--pipeline.layer_costs=[1.0, 2.0]"], "pipeline.layer_costs", "partition='params'"),
    (2, ["--parallel.pp=2", "--pipeline.schedule=naive", "--pipeline.microbatches=2"], "pipeline.microbatches",
     "naive"),
    (1, ["--tensor_parallel.mode=2d"], "tensor_parallel.mode", "parallel.tp=1"),
    (2, ["--tensor_parallel.sequence_parallel=true"], "tensor_parallel.sequence_parallel", "parallel.tp=1"),
    (2, ["--parallel.tp=2", "--tensor_parallel.depth=2"], "tensor_parallel.depth", "mode='1d'"),
    (2, ["--context_parallel.method=ulysses"], "context_parallel.method", "parallel.cp=1"),
    (1, ["--moe.top_k=1"], "moe.top_k", "model.num_experts=0"),
    (1, ["--model.moe_every=1"], "model.moe_every", "model.num_experts=0"),
    (1, [*MOE, "--moe.jitter_eps=0.1"], "moe.jitter_eps", "noisy_gate_policy='none'"),
    (2, ["--zero.bucket_mb=5"], "zero.bucket_mb", "zero_stage=0"),
    (2, ["--parallel.zero_stage=2", "--zero.prefetch=false"], "zero.prefetch", "zero_stage=2"),
    (2, ["--parallel.zero_stage=3", "--zero.min_params=10"], "zero.min_params", "wrap_policy='block'"),
    (1, ["--ddp.bucket_mb=5"], "ddp.bucket_mb", "single data-parallel rank"),
    (2, ["--parallel.zero_stage=1", "--ddp.bucket_mb=5"], "ddp.bucket_mb", "a ZeRO engine reduces"),
    (4, ["--parallel.pp=2", "--parallel.zero_stage=1", "--ddp.bucket_mb=5"], "ddp.bucket_mb", "a ZeRO engine reduces"),
    (2, ["--parallel.pp=2", "--ddp.find_unused_parameters=true"], "ddp.find_unused_parameters",
     "single data-parallel rank"),
    (1, ["--precision.init_scale=1024"], "precision.init_scale", "loss_scale='auto' with precision.dtype='fp32'"),
    (1, ["--checkpointing.every=2"], "checkpointing.every", "checkpointing.mode='none'"),
    (1, ["--ps.servers=3"], "ps.servers", "model.preset='tiny'"),
    (2, [*AUTO, "--parallel.tp=2"], "parallel.tp", "parallel.auto=true chooses it"),
    (2, ["--parallel.auto=true"], "data.micro_batch_size", "parallel.auto"),
]
# the same keys where they act
ACCEPTED = [
    (2, ["--parallel.pp=2", "--pipeline.schedule=gpipe", "--pipeline.microbatches=2"]),
    (2, ["--parallel.pp=2", "--pipeline.partition=cost", "--pipeline.layer_costs=[1.0, 2.0]"]),
    (2, ["--parallel.tp=2", "--tensor_parallel.sequence_parallel=true"]),
    (2, ["--parallel.cp=2", "--context_parallel.method=ulysses"]),
    (1, [*MOE, "--moe.top_k=1", "--model.moe_every=1"]),
    (1, [*MOE, "--moe.noisy_gate_policy=jitter", "--moe.jitter_eps=0.1"]),
    (2, ["--parallel.zero_stage=1", "--zero.bucket_mb=5"]),
    (1, ["--precision.dtype=bf16", "--zero.bucket_mb=5"]),  # mixed precision: an fp32-master engine
    (2, ["--parallel.zero_stage=3", "--zero.prefetch=false", "--zero.wrap_policy=size", "--zero.min_params=10"]),
    (2, ["--ddp.bucket_mb=5", "--ddp.find_unused_parameters=true"]),
    (4, ["--parallel.pp=2", "--ddp.bucket_mb=5"]),  # a pipeline's data parallelism reads [ddp]
    (2, [*MOE, "--parallel.ep=2", "--ddp.bucket_mb=5"]),  # so do expert parallelism's two reducers
    (1, ["--precision.dtype=fp16", "--precision.init_scale=1024", "--precision.growth_interval=10"]),
    (1, ["--checkpointing.mode=full", "--checkpointing.every=2"]),
    (2, ["--pipeline.schedule=1f1b", "--moe.top_k=2", "--zero.bucket_mb=25"]),  # defaults: never refused
    (2, [*AUTO, "--parallel.order=pp-dp_replicate-dp_shard-cp-tp", "--parallel.timeout_s=60"]),
]


@pytest.mark.parametrize("world, args, key, why", REFUSED)
def test_a_setting_without_effect_is_refused(world, args, key, why):
    with pytest.raises(ConfigError) as err:
        resolve_job(load_config(None, [*TINY, *args]), world)
    message = str(err.value)
    assert message.startswith(f"{key}=") and "has no effect" in message and why in message, message


@pytest.mark.parametrize("world, args", ACCEPTED)
def test_the_same_settings_where_they_act_are_accepted(world, args):
    resolve_job(load_config(None, [*TINY, *args]), world)


def test_a_setting_from_the_toml_file_is_judged_like_an_override(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('[model]\npreset = "tiny"\n[data]\nseq_len = 32\n[context_parallel]\nmethod = "ulysses"\n')
    with pytest.raises(ConfigError, match=r"context_parallel.method='ulysses' has no effect"):
        validate_config(load_config(str(config)), 2)


def test_the_cli_refuses_with_one_sentence(capsys):
    assert main(["train", "--nproc", "1", *TINY, "--tensor_parallel.mode=3d"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera: error: tensor_parallel.mode='3d' has no effect") and len(err.splitlines()) == 1


def test_the_parameter_server_mode_refuses_the_trainers_keys(capsys):
    assert main(["train", "--model.preset=ctr", "--optim.lr=0.1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr=0.1 has no effect" in err and "parameter-server job" in err
    assert main(["train", "--model.preset=ctr", "--ps.servers=1", "--train.steps=5", "--dry-run"]) == 0


@pytest.mark.parametrize("precision", [{}, {"dtype": "bf16"}, {"reduce_dtype": "bf16"}])
def test_zero_keys_are_judged_by_the_rule_parallelize_follows(precision):
    """One process: parallelize builds a sharded engine exactly when engine_holds_optimizer says so, and
    a [zero] key is accepted exactly then."""
    from tessera.data_parallel import DDPConfig
    from tessera.models import Transformer
    from tessera.parallelize import engine_holds_optimizer, is_sharded, parallelize
    from tessera.precision import PrecisionConfig
    from tessera.topology import ParallelConfig, Topology
    from tessera.train.optim import OptimConfig, optimizer_factory, param_groups

    cfg = load_config(None, [*TINY, *(f"--precision.{k}={v}" for k, v in precision.items()), "--zero.bucket_mb=5"])
    topology = Topology.build(ParallelConfig())
    built = parallelize(Transformer(cfg.model), topology, DDPConfig(), precision=PrecisionConfig(**precision),
                        param_groups=lambda m: param_groups(m, OptimConfig()),
                        make_optimizer=optimizer_factory(OptimConfig()))
    engine = engine_holds_optimizer(topology.config, PrecisionConfig(**precision))
    assert is_sharded(built) == engine == bool(precision)
    if engine:
        resolve_job(cfg, 1)
    else:
        with pytest.raises(ConfigError, match="zero.bucket_mb=5.0 has no effect"):
            resolve_job(cfg, 1)


def test_parallel_auto_writes_exactly_the_keys_it_reserves():
    from tessera.train.auto_layout import AUTO_KEYS, chosen_settings

    degrees = {"dp_replicate": 1, "dp_shard": 1, "pp": 2, "tp": 2, "cp": 1, "ep": 1, "zero_stage": 0,
               "sequence_parallel": True, "schedule": "1f1b", "micro_batch_size": 2}
    chosen = chosen_settings(degrees)  # a full choice: every key auto may write, and no other
    assert sorted(chosen) == sorted(AUTO_KEYS)
    cfg = load_config(None, TINY)
    from tessera.train.auto_layout import _write

    _write(cfg, degrees)
    assert {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in AUTO_KEYS} == chosen


# ---- pairings judged before launch --------------------------------------------------------------


def test_pipedream_with_tied_embeddings_is_refused_before_any_rank_starts(tmp_path, capsys):
    args = ["train", "--nproc", "2", *TINY, "--parallel.pp=2", "--pipeline.schedule=pipedream",
            "--model.tie_embeddings=true", f"--run.out_dir={tmp_path}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera: error: tied embeddings with the asynchronous pipedream schedule")
    assert len(err.splitlines()) == 1 and not any(tmp_path.iterdir())
    untied = [a for a in args if a != "--model.tie_embeddings=true"]
    assert main([*untied, "--dry-run"]) == 0  # untied, pipedream is accepted


def test_expert_parallel_layouts_resolve_with_and_without_hybrid_sharding():
    """dp_shard=4 with ep=2 on 4 ranks leaves dp_replicate=1 (plain sharding); dp_shard=2 makes it
    dp_replicate=2 × dp_shard=2 (hybrid sharding): both are accepted under ep."""
    for shard, replicate in ((4, 1), (2, 2)):
        par = resolve_job(load_config(None, [*TINY, *MOE, f"--parallel.dp_shard={shard}", "--parallel.ep=2",
                                             "--parallel.zero_stage=1"]), 4)
        assert (par.dp_replicate, par.dp_shard) == (replicate, shard)


@pytest.mark.multirank
def test_expert_parallel_zero1_over_dp_shard_trains_like_one_process(rank_pool, tmp_path, corpus_cache):
    moe = ["--model.n_layers=4", *MOE, "--checkpoint.save_final=false"]
    single = run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, steps=3, extra=[*moe, "--run.name=ref"])))
    args = tiny_args(tmp_path, corpus_cache, steps=3, extra=[*moe, "--parallel.dp_shard=4", "--parallel.ep=2",
                                                             "--parallel.zero_stage=1", "--run.name=ep"])
    resolve_job(load_config(None, args), 4)  # validation passes first, as the CLI runs it
    results = rank_pool.run(trainer_worker, 4, args=args, timeout=600.0)
    assert results[0]["layout"].startswith("4 rank(s): dp_shard=4 ep=2")
    assert_like_single_process(results, single, metrics(tmp_path / "ref"), metrics(tmp_path / "ep"), 4)


# ---- a run's resolved config.toml is accepted back -----------------------------------------------


@pytest.mark.parametrize("world, path, args", [
    (8, None, DEMO_LAYOUT),
    (8, "configs/default.toml", []),
    (2, "configs/tiny.toml", []),
    (4, None, [*TINY, *AUTO]),
    (4, None, [*TINY, "--parallel.pp=2", "--parallel.tp=2", "--tensor_parallel.sequence_parallel=true"]),
    (4, None, ["--model.preset=moe-small", "--parallel.ep=2", "--parallel.zero_stage=2", "--moe.top_k=1"]),
    (2, None, ["--parallel.zero_stage=3", "--precision.dtype=bf16", "--checkpointing.mode=selective"]),
    (1, None, ["--model.preset=ctr", "--ps.mode=ssp"]),
])
def test_the_resolved_config_a_run_writes_is_accepted_back(tmp_path, world, path, args):
    cfg = load_config(str(ROOT / path) if path else None, args)
    resolve_job(cfg, world)  # what the CLI does before launch (parallel.auto resolved, then cleared)
    save_config(cfg, tmp_path / "config.toml")  # what the trainer writes into the run folder
    again = load_config(str(tmp_path / "config.toml"))
    resolve_job(again, world)
    assert config_dict(again) == config_dict(cfg)
