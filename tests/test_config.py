"""Config loading, overrides and validation (pure tier), and the CLI's answers to bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.errors import ConfigError
from tessera.train.config import config_dict, load_config, save_config, validate_config
from tessera.train.config_io import parse_overrides
from tessera.train.optim import OptimConfig, lr_factor

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_the_small_preset_with_data_parallelism():
    cfg = validate_config(load_config(), 2)
    assert cfg.model_preset == "small" and cfg.model.dim == 256
    assert cfg.parallel.resolved(2).dp_replicate == 2


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\npreset = "tiny"\nn_layers = 3\n[train]\nsteps = 7\n[optim]\nlr = 1\n')
    cfg = load_config(str(path), ["--train.steps=9", "--model.dim", "64", "--ddp.find_unused_parameters=true"])
    assert cfg.model_preset == "tiny" and cfg.model.n_layers == 3 and cfg.model.dim == 64
    assert cfg.train.steps == 9 and cfg.optim.lr == 1.0 and cfg.ddp.find_unused_parameters is True


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--model.preset=tiny", "--data.seq_len=32", "--parallel.tp=1"])
    save_config(cfg, tmp_path / "config.toml")
    again = load_config(str(tmp_path / "config.toml"))
    assert config_dict(again) == config_dict(cfg)


@pytest.mark.parametrize("args, message", [
    (["--model.n_layer=3"], "unknown config key 'model.n_layer' (did you mean 'model.n_layers'?)"),
    (["--trian.steps=3"], "unknown config section 'trian' (did you mean 'train'?)"),
    (["--train.steps=many"], "config key 'train.steps' expects int, got 'many'"),
    (["--model.preset=huge"], "huge"),
    (["train.steps=3"], "overrides look like --section.key=value"),
])
def test_bad_keys_and_values(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    assert message in str(err.value)


@pytest.mark.parametrize("args, world, message", [
    (["--parallel.dp_replicate=3"], 2, "multiply to 3, not the world size 2"),
    (["--data.corpus=/no/such/corpus"], 2, "/no/such/corpus"),
    (["--data.global_batch_size=6"], 4, "not divisible"),
    (["--data.seq_len=512"], 1, "exceeds model.max_seq_len"),
    (["--optim.lr=-1"], 1, "optim.lr must be positive"),
])
def test_validation(args, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(None, args), world)


def test_parse_overrides_needs_a_value():
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--train.steps"])


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg, 100) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert factors[-1] == pytest.approx(0.1)


@pytest.mark.parametrize("args, message", [
    (["train", "--model.nlayers=2"], "unknown config key 'model.nlayers'"),
    (["train", "--nproc", "2", "--parallel.dp_replicate=4"], "not the world size 2"),
    (["train", "--data.corpus=/no/such/dir"], "corpus path '/no/such/dir' does not exist"),
    (["train", "--nproc", "3", "--parallel.tp=3"], "parallel.tp=3 must divide the model's n_heads (8)"),
    (["train", "--nproc", "8", "--parallel.pp=8"], "exceeds the model's 4 layers"),
    (["train", "--nproc", "2", "--parallel.pp=2", "--pipeline.microbatches=3"], "does not divide the batch size 16"),
    (["train", "--nproc", "2", "--model.preset=moe-small", "--model.num_experts=3", "--parallel.ep=2"],
     "parallel.ep=2 must divide the number of experts 3"),
    (["train", "--nproc", "4", "--parallel.pp=2", "--parallel.zero_stage=3", "--pipeline.schedule=2bw"],
     "ZeRO-3 with the weight-stashing pipeline.schedule='2bw'"),
    (["train", "--nproc", "8", "--parallel.cp=4", "--data.seq_len=100"], "must be divisible by 2·cp = 8"),
    (["train", "--config", "/no/such.toml"], "config file '/no/such.toml' does not exist"),
])
def test_cli_bad_input_is_one_sentence_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera: error: ") and message in err
    assert len(err.splitlines()) == 1  # one sentence, no traceback


def test_cli_bad_input_from_a_real_process_exits_2():
    """The console entry point, as a user runs it: exit code 2 before any rank starts."""
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--nproc", "3"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "global_batch_size=16 is not divisible" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_config_key_is_documented():
    from tessera.train.config import SECTIONS
    from tessera.train.config_io import field_types

    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    for section, cls in SECTIONS.items():
        assert f"## `[{section}]`" in doc, section
        for key in field_types(cls):
            assert f"| `{key}` |" in doc, f"{section}.{key}"


@pytest.mark.parametrize("name", ["default.toml", "tiny.toml"])
def test_shipped_configs_load(name):
    cfg = load_config(str(ROOT / "configs" / name))
    validate_config(cfg, cfg.run.nproc)


def test_default_toml_says_what_no_arguments_do():
    """`tessera train` without a layout runs the demo layout (tessera.cli.DEMO_LAYOUT); the file says so."""
    from tessera.cli import DEMO_LAYOUT

    demo = load_config(None, DEMO_LAYOUT)
    assert config_dict(load_config(str(ROOT / "configs" / "default.toml"))) == config_dict(demo)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parallel_auto_picks_a_layout_that_validates(world):
    from tessera.train.auto_layout import apply_auto_layout

    cfg = load_config(None, ["--parallel.auto=true", "--model.preset=tiny", "--data.seq_len=32"])
    chosen = apply_auto_layout(cfg, world)
    par = cfg.parallel
    assert par.dp_replicate * par.dp_shard * par.pp * par.tp * par.cp == world
    assert chosen["step_time_s"] > 0 and par.zero_stage == chosen["zero_stage"]
    validate_config(cfg, world)  # the planner's choice is one the trainer can run
