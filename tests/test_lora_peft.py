"""LoRA adapters in PEFT's format, checked logit for logit against ``peft`` on the same ``transformers`` model.

Tiny random Llama / Qwen2 models are built locally (nothing downloaded); one process, fp32. Every adapter's
B is set non-zero (a fresh adapter's B = 0 would make any adapter, or none, give the base logits).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import tessera.hf  # noqa: E402
from tessera.errors import ConfigError, UserError  # noqa: E402
from tessera.hf.convert import attach_weights, read_config  # noqa: E402
from tessera.lora import LoRAConfig, add_lora  # noqa: E402
from tessera.lora.peft import (attach_peft, check_init_from, load_peft, peft_name,  # noqa: E402
                               read_peft_config, save_peft, tessera_name)
from tessera.models.init import materialize  # noqa: E402
from tessera.models.llama import Transformer  # noqa: E402

TOL = 1e-5
SHAPE = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, max_position_embeddings=32, rope_theta=5000.0, rms_norm_eps=1e-5)
ALL = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


def hf_base(folder, family="llama", seed=0):
    """A tiny random transformers model saved to ``folder``; returns it (eval)."""
    torch.manual_seed(seed)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](**SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return model


def tokens(seq=12):
    return torch.randint(0, 61, (2, seq), generator=torch.Generator().manual_seed(3))


def hf_logits(model):
    with torch.no_grad():
        return model(tokens()).logits


def ts_logits(model):
    with torch.no_grad():
        return model.eval()(tokens())


def randomize_adapters(named_params, seed=5):
    """Give every LoRA factor (A and B) random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_params:
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("family,targets", [("llama", ALL), ("qwen2", ["wq", "wv", "w2"])])
def test_adapter_saved_by_tessera_loads_in_peft(tmp_path, family, targets):
    hf_base(tmp_path / "base", family)
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=targets)
    ours = tessera.hf.load(tmp_path / "base")
    add_lora(ours, cfg, seed=1)
    randomize_adapters(ours.named_parameters())
    save_peft(ours, cfg, tmp_path / "adapter")

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    plain = hf_logits(base)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    expected = ts_logits(ours)
    torch.testing.assert_close(hf_logits(theirs), expected, atol=TOL, rtol=0)
    assert not torch.allclose(plain, expected, atol=1e-3)  # the adapter changes the logits
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8 and saved["init_lora_weights"] == "gaussian"
    assert sorted(theirs.peft_config["default"].target_modules) == saved["target_modules"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_adapter_saved_by_peft_loads_in_tessera(tmp_path, family):
    hf = hf_base(tmp_path / "base", family)
    config = peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.1, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"])
    theirs = peft.get_peft_model(hf, config)
    randomize_adapters(theirs.named_parameters())
    theirs.save_pretrained(tmp_path / "adapter")

    ours = tessera.hf.load(tmp_path / "base")
    cfg = load_peft(ours, tmp_path / "adapter")
    assert (cfg.rank, cfg.alpha, cfg.dropout, sorted(cfg.targets)) == (4, 12.0, 0.1, ["w2", "w3", "wk", "wo", "wq"])
    torch.testing.assert_close(ts_logits(ours), hf_logits(theirs.eval()), atol=TOL, rtol=0)
    trainable = sorted(n for n, p in ours.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_adapter_read_on_the_meta_device_equals_the_real_load(tmp_path):
    """``[lora] init_from``'s path: adapters attached to a meta model as file origins, then materialised."""
    hf_base(tmp_path / "base")
    cfg = LoRAConfig(rank=2, alpha=4.0, targets=["wq", "w1"])
    ours = tessera.hf.load(tmp_path / "base")
    add_lora(ours, cfg, seed=1)
    randomize_adapters(ours.named_parameters())
    save_peft(ours, cfg, tmp_path / "adapter")

    model_cfg, _ = read_config(tmp_path / "base")
    with torch.device("meta"):
        meta = Transformer(model_cfg, None, seed=0)
    attach_weights(meta, tmp_path / "base")
    add_lora(meta, cfg, seed=99)  # another seed: the folder's values must win
    attach_peft(meta, tmp_path / "adapter", cfg)
    materialize(meta, torch.device("cpu"), torch.float32)
    for name, p in ours.state_dict().items():
        assert torch.equal(meta.state_dict()[name], p), name


def test_names_round_trip():
    name = "layers.1.feed_forward.w3.lora_B.weight"
    assert peft_name(name) == "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    assert tessera_name(peft_name(name)) == name
    assert tessera_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") is None
    with pytest.raises(ConfigError, match="no PEFT counterpart"):
        peft_name("layers.0.feed_forward.experts.1.w1.lora_A.weight")


def saved_adapter(tmp_path, cfg=LoRAConfig(rank=2, alpha=4.0, targets=["wq"])):
    hf_base(tmp_path / "base")
    ours = tessera.hf.load(tmp_path / "base")
    add_lora(ours, cfg, seed=0)
    save_peft(ours, cfg, tmp_path / "adapter")
    return tmp_path / "adapter"


REFUSED = [("use_rslora", True, "use_rslora"), ("use_dora", True, "use_dora"), ("bias", "all", "bias"),
           ("modules_to_save", ["lm_head"], "modules_to_save"), ("rank_pattern", {"q_proj": 4}, "rank_pattern"),
           ("init_lora_weights", "pissa", "changes the base weights"), ("peft_type", "IA3", "LoRA adapters only"),
           ("target_modules", "all-linear", "targets"), ("target_modules", ["q_proj", "lm_head"], "targets")]


@pytest.mark.parametrize("key,value,match", REFUSED, ids=[f"{k}={v}" for k, v, _ in REFUSED])
def test_an_adapter_tessera_does_not_compute_is_refused(tmp_path, key, value, match):
    folder = saved_adapter(tmp_path)
    raw = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ConfigError, match=match):
        read_peft_config(folder)


@pytest.mark.parametrize("change,match", [(dict(rank=4), "lora.rank=4 differs"), (dict(alpha=8.0), "lora.alpha"),
                                          (dict(targets=["wq", "wv"]), "lora.targets")])
def test_init_from_an_adapter_of_other_settings_is_refused(tmp_path, change, match):
    folder = saved_adapter(tmp_path)
    cfg = LoRAConfig(**{**dict(rank=2, alpha=4.0, targets=["wq"]), **change})
    model = tessera.hf.load(tmp_path / "base")
    add_lora(model, cfg, seed=0)
    with pytest.raises(ConfigError, match=match):
        attach_peft(model, folder, cfg)


def test_an_adapter_of_another_model_is_refused(tmp_path):
    folder = saved_adapter(tmp_path)
    cfg = LoRAConfig(rank=2, alpha=4.0, targets=["wq"])
    wider = dataclasses.replace(read_config(tmp_path / "base")[0], dim=64)
    with torch.device("meta"):
        other = Transformer(wider, None, seed=0)
    add_lora(other, cfg, seed=0)
    with pytest.raises(ConfigError, match="has shape"):
        attach_peft(other, folder, cfg)
    with pytest.raises(UserError, match="expected a PEFT LoRA adapter folder"):
        read_peft_config(tmp_path / "base")


# ---- [lora] init_from: a PEFT adapter as the adapters' initial values in training ---------------------
FLAGS = ["--lora.rank=4", "--lora.alpha=8", "--lora.targets=[\"wq\",\"wv\",\"wo\",\"w2\"]"]


def peft_adapter(tmp_path):
    """A tiny HF Llama (byte vocabulary) and a PEFT adapter on it with random A and B, matching FLAGS."""
    from test_hf_shards import hf_model

    hf = hf_model(tmp_path / "base", "llama", seed=5, vocab_size=257)
    config = peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    theirs = peft.get_peft_model(hf, config)
    randomize_adapters(theirs.named_parameters(), seed=11)
    theirs.save_pretrained(tmp_path / "adapter")
    return theirs.eval()


def test_init_from_starts_the_job_model_at_the_peft_model(tmp_path):
    from tessera.train.config import load_config, validate_config
    from tessera.train.trainer import meta_model

    theirs = peft_adapter(tmp_path)
    cli = [f"--model.hf={tmp_path / 'base'}", *FLAGS, f"--lora.init_from={tmp_path / 'adapter'}"]
    cfg = validate_config(load_config(None, cli), 1)
    model = meta_model(cfg)  # what every rank builds: adapters with the folder's tensors as origins
    materialize(model, torch.device("cpu"))
    x = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), theirs(x).logits, atol=TOL, rtol=0)
    with pytest.raises(ConfigError, match="lora.rank=8 differs"):
        validate_config(load_config(None, [*cli, "--lora.rank=8"]), 1)
    with pytest.raises(UserError, match="expected a PEFT LoRA adapter folder"):
        validate_config(load_config(None, [*cli[:-1], f"--lora.init_from={tmp_path}"]), 1)
    check_init_from(cfg.lora, cfg.model)  # headers fit the model
    with pytest.raises(ConfigError, match="has shape"):
        check_init_from(cfg.lora, dataclasses.replace(cfg.model, dim=64))


@pytest.mark.multirank
def test_init_from_trains_alike_at_tp2(rank_pool, tmp_path, corpus_cache):
    """Each tp rank reads its slices of the adapter file (A's columns under a row-parallel layer, B's rows
    under a column-parallel one): the run equals one process, and starts elsewhere than a fresh adapter."""
    from tessera.launch import run_rank
    from tessera.train.config import load_config

    from test_hf_shards import finetune_args
    from test_trainer import trainer_worker
    from test_trainer_strategies import assert_like_single_process, metrics

    peft_adapter(tmp_path)
    start = [*FLAGS, f"--lora.init_from={tmp_path / 'adapter'}"]
    single = run_rank(load_config(None, finetune_args(tmp_path, corpus_cache, tmp_path / "base", "one", start)))
    fresh = run_rank(load_config(None, finetune_args(tmp_path, corpus_cache, tmp_path / "base", "fresh", FLAGS)))
    assert abs(single["val_loss_start"] - fresh["val_loss_start"]) > 1e-3
    args = finetune_args(tmp_path, corpus_cache, tmp_path / "base", "tp2", [*start, "--parallel.tp=2"])
    results = rank_pool.run(trainer_worker, 2, args=args)
    assert results[0]["layout"].startswith("2 rank(s): tp=2")
    assert_like_single_process(results, single, metrics(tmp_path / "one"), metrics(tmp_path / "tp2"), 2)
