"""ZeRO-3 manual wrapping from the configuration (seed 001's ``wrap()`` inside ``enable_wrap``, as config keys):
``zero.wrap_policy = "manual"`` with ``zero.wrap_paths`` (module paths, ``*`` = one component) or
``zero.wrap_classes`` (class names) makes exactly those modules units; entries that match nothing, or a
module whose forward never runs, are refused before any rank starts. The entries are matched against the
model as the job runs it: with LoRA's adapted linears (``LoRALinear``, also a "Linear") and tensor parallelism's
layers (``ColumnParallelLinear`` / ``RowParallelLinear``, which answer to "Linear" too), at the paths of the
layers they replace."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tessera.cli import main
from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.models import model_config
from tessera.models.layers import TransformerBlock
from tessera.models.llama import Transformer
from tessera.train.config import load_config, validate_config
from tessera.zero import ZeroConfig
from tessera.zero.build import wrap_policy
from tessera.lora.layer import ADAPTER_PARTS
from tessera.train.wrap_check import running_model
from tessera.zero.wrap import FACTORS, path_matches, select_units

from test_trainer import tiny_args

MANUAL = ["--parallel.zero_stage=3", "--zero.wrap_policy=manual"]
CLASSES = '--zero.wrap_classes=["FeedForward", "Attention"]'


def meta_tiny(n_layers: int = 2) -> Transformer:
    with torch.device("meta"):
        return Transformer(model_config("tiny", n_layers=n_layers))


def units_of(model: nn.Module, **zero) -> list[nn.Module]:
    return select_units(model, wrap_policy(ZeroConfig(**zero), TransformerBlock, model))


def test_a_star_stands_for_exactly_one_path_component():
    assert path_matches("layers.*", "layers.3") and path_matches("layers.*.feed_forward", "layers.0.feed_forward")
    assert not path_matches("layers.*", "layers.3.feed_forward") and not path_matches("layers.*", "layers")
    assert path_matches("output", "output") and not path_matches("output", "layers.0.output")


def test_paths_of_the_blocks_embedding_and_head_give_the_block_policys_units():
    model = meta_tiny()
    block = units_of(model)  # the default policy: each block, the embedding and the head
    by_path = units_of(model, wrap_policy="manual", wrap_paths=["tok_embeddings", "layers.*", "output"])
    assert by_path == block and len(block) == 1 + 2 + 2
    only_blocks = units_of(model, wrap_policy="manual", wrap_paths=["layers.*"])
    assert only_blocks == [model, model.layers["0"], model.layers["1"]]  # the root takes embedding and head


def test_class_names_give_one_unit_per_instance_and_units_may_nest():
    model = meta_tiny()
    units = units_of(model, wrap_policy="manual", wrap_classes=["FeedForward", "Attention"])
    assert len(units) == 1 + 2 * 2
    assert {type(u).__name__ for u in units[1:]} == {"FeedForward", "Attention"}
    nested = units_of(model, wrap_policy="manual", wrap_paths=["layers.*", "layers.*.feed_forward"])
    assert nested[1:] == [model.layers["0"], model.layers["0"].feed_forward, model.layers["1"],
                          model.layers["1"].feed_forward]


@pytest.mark.parametrize("args, message", [
    (["--parallel.zero_stage=3", '--zero.wrap_paths=["layers.*"]'], "applies only with zero.wrap_policy='manual'"),
    (["--parallel.zero_stage=1", "--zero.wrap_policy=manual", '--zero.wrap_paths=["layers.*"]'],
     "applies only to ZeRO-3"),
    ([*MANUAL, '--zero.wrap_paths=["layers.9"]'], "'layers.9' matches no module of the model"),
    ([*MANUAL, '--zero.wrap_paths=["layers.*.attention.core_attention"]'], "only modules without parameters"),
    ([*MANUAL, '--zero.wrap_paths=[""]'], "zero.wrap_paths holds an empty name"),
])
def test_settings_that_cannot_make_units_are_refused(args, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(load_config(None, ["--model.preset=tiny", *args]), 2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arg, sentence", [
    ('--zero.wrap_classes=["Block"]',
     "tessera: error: zero.wrap_classes entry 'Block' matches no module of the model as this job runs it (its "
     "classes: Attention, CausalCoreAttention, Dropout, Embedding, FeedForward, Linear, RMSNorm, TransformerBlock)"),
    ('--zero.wrap_paths=["layers"]',
     "tessera: error: zero.wrap_paths entry 'layers' names 'layers', a module whose forward never runs, so "
     "ZeRO-3 could never gather its parameters; name its entries instead (e.g. 'layers.*')"),
])
def test_cli_refuses_wrap_targets_before_any_rank_starts(tmp_path, capsys, arg, sentence):
    code = main(["train", "--dry-run", "--nproc", "2", "--model.preset=tiny", *MANUAL, arg,
                 f"--run.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [sentence]
    assert not any(tmp_path.iterdir())


def job(*args: str, world: int = 2):
    """The validated config of a tiny manual-units ZeRO-3 job on ``world`` ranks and its resolved layout."""
    cfg = validate_config(load_config(None, ["--model.preset=tiny", *MANUAL, *args]), world)
    return cfg, cfg.parallel.resolved(world)


def test_lora_layers_are_units_by_their_class_and_by_the_paths_of_the_layers_they_replace():
    """LoRA puts a LoRALinear at the path of each adapted nn.Linear: the class and the old paths name it;
    "Linear" names it too (a LoRALinear is one), never its adapter factors, whose forward never runs."""
    assert FACTORS == ADAPTER_PARTS
    lora = ["--lora.rank=4", '--lora.targets=["wq", "wv"]']
    cfg, par = job(*lora, '--zero.wrap_classes=["LoRALinear"]')
    model = running_model(cfg, par)
    units = units_of(model, **{"wrap_policy": "manual", "wrap_classes": ["LoRALinear"]})
    assert [type(u).__name__ for u in units] == ["Transformer"] + ["LoRALinear"] * 4
    assert units[1] is model.layers["0"].attention.wq
    assert units_of(model, wrap_policy="manual", wrap_paths=["layers.*.attention.wq", "layers.*.attention.wv"]) \
        == units
    linears = units_of(model, wrap_policy="manual", wrap_classes=["Linear"])  # 7 per block and the head
    assert len(linears) == 1 + 2 * 7 + 1 and not any(n.endswith(FACTORS) for n, m in model.named_modules()
                                                       if any(m is u for u in linears))
    with pytest.raises(ConfigError, match="'layers.0.attention.wq.lora_A', a module whose forward never runs"):
        job(*lora, '--zero.wrap_paths=["layers.*.attention.wq.lora_A"]')


def test_under_tensor_parallelism_linear_names_the_parallel_linears_and_a_missing_class_is_refused():
    """tp replaces each nn.Linear by a Column/RowParallelLinear (the head by a VocabParallelHead) at the same
    path; "Linear" names them all (the documented stand-in), so a unit list means the same layers with and
    without tp. A class that the job as it runs does not have is refused before launch."""
    cfg, par = job("--parallel.tp=2", '--zero.wrap_classes=["Linear"]')
    model = running_model(cfg, par)
    units = units_of(model, wrap_policy="manual", wrap_classes=["Linear"])
    kinds = [type(u).__name__ for u in units]
    assert kinds == ["Transformer"] + ["ColumnParallelLinear"] * 3 + ["RowParallelLinear"] \
        + ["ColumnParallelLinear"] * 2 + ["RowParallelLinear"] + kinds[1:8] + ["VocabParallelHead"]
    assert units_of(model, wrap_policy="manual", wrap_paths=["layers.*.feed_forward.w2"]) \
        == [model, model.layers["0"].feed_forward.w2, model.layers["1"].feed_forward.w2]
    for args, message in [
        (["--parallel.tp=2", "--lora.rank=4", '--zero.wrap_classes=["LoRALinear"]'],
         "'LoRALinear' matches no module of the model as this job runs it"),  # tp's layers carry the adapters
        (['--zero.wrap_classes=["ColumnParallelLinear"]'], "'ColumnParallelLinear' matches no module"),
        (["--parallel.tp=4", "--tensor_parallel.mode=2d", '--zero.wrap_classes=["Linear"]'],
         "zero.wrap_classes cannot be checked under tensor_parallel.mode='2d'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            job(*args, world=4 if "--tensor_parallel.mode=2d" in args else 2)


def units_worker(rank, world_size, args):
    """One rank of a training run; returns its summary and the class names of its ZeRO-3 units."""
    from tessera.train.trainer import Trainer

    trainer = Trainer(load_config(None, args), torch.device("cpu"))
    try:
        units = [type(u.module).__name__ for u in trainer.engine.units]
        return {"units": units, **trainer.fit()}
    finally:
        trainer.close()


def train_losses(run_dir: Path) -> list[float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def assert_like(results, single, run_dir: Path, ref_dir: Path):
    """Every rank's summary and every step's loss equal the single process's (fp32: rel 1e-5)."""
    for key in ("val_loss_start", "val_loss_end", "train_loss_end"):
        assert {r[key] for r in results} == {results[0][key]}
        assert results[0][key] == pytest.approx(single[key], rel=1e-5), key
    want = train_losses(ref_dir)
    assert len(want) == 2 and train_losses(run_dir) == pytest.approx(want, rel=1e-5)


@pytest.mark.multirank
def test_zero3_units_by_class_and_by_path_under_pp_match_single_process(rank_pool, tmp_path, corpus_cache):
    """dp2 ZeRO-3 with a unit per FeedForward and per Attention, and pp2 × dp2 ZeRO-3 with the blocks, their
    feed-forwards (units inside units) and the head named by path (each stage's units are the listed modules it
    holds), train like one process."""
    steps = ["--train.log_every=1", "--train.eval_every=2"]
    single = run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, steps=2, extra=[*steps, "--run.name=ref"])))
    by_class = rank_pool.run(units_worker, 2, args=tiny_args(
        tmp_path, corpus_cache, steps=2, extra=[*steps, *MANUAL, CLASSES, "--run.name=cls"]))
    for r in by_class:
        assert r["units"] == ["Transformer", "Attention", "FeedForward", "Attention", "FeedForward"]
    assert_like(by_class, single, tmp_path / "cls", tmp_path / "ref")
    pp = ["--parallel.pp=2", "--pipeline.microbatches=2",
          '--zero.wrap_paths=["layers.*", "layers.*.feed_forward", "output"]']  # nested: a block and its ffn
    piped = rank_pool.run(units_worker, 4, args=tiny_args(
        tmp_path, corpus_cache, steps=2, extra=[*steps, *MANUAL, *pp, "--run.name=pp"]))
    stages = sorted({tuple(r["units"]) for r in piped})
    # stage 0 holds block 0 and the embedding (the root takes it), stage 1 block 1, the norm and the head
    assert stages == [("Module", "TransformerBlock", "FeedForward"),
                      ("Module", "TransformerBlock", "FeedForward", "Linear")]
    assert_like(piped, single, tmp_path / "pp", tmp_path / "ref")


@pytest.mark.multirank
def test_zero3_units_of_lora_and_tensor_parallel_layers_match_single_process(rank_pool, tmp_path, corpus_cache):
    """The layers that really run are the units: dp2 ZeRO-3 with a unit per LoRALinear, and tp2 ZeRO-3 with
    "Linear" naming the tensor-parallel linears, train like one process (each with its own reference)."""
    steps = ["--train.log_every=1", "--train.eval_every=2"]
    lora = ["--lora.rank=4", '--lora.targets=["wq", "wv"]']
    single = run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, steps=2, extra=[*steps, "--run.name=ref"])))
    single_lora = run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, steps=2,
                                                       extra=[*steps, *lora, "--run.name=lref"])))
    adapted = rank_pool.run(units_worker, 2, args=tiny_args(tmp_path, corpus_cache, steps=2, extra=[
        *steps, *MANUAL, *lora, '--zero.wrap_classes=["LoRALinear"]', "--run.name=lora"]))
    for r in adapted:
        assert r["units"] == ["Transformer"] + ["LoRALinear"] * 4
    assert_like(adapted, single_lora, tmp_path / "lora", tmp_path / "lref")
    split = rank_pool.run(units_worker, 2, args=tiny_args(tmp_path, corpus_cache, steps=2, extra=[
        *steps, *MANUAL, "--parallel.tp=2", '--zero.wrap_classes=["Linear"]', "--run.name=tp"]))
    for r in split:  # 7 linears per block, then the head: none left to the root
        assert r["units"][0] == "Transformer" and len(r["units"]) == 1 + 2 * 7 + 1
        assert set(r["units"][1:]) == {"ColumnParallelLinear", "RowParallelLinear", "VocabParallelHead"}
    assert_like(split, single, tmp_path / "tp", tmp_path / "ref")
