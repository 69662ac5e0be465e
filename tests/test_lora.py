"""LoRA in the trainer, one process: only the adapters train, the base weights stay bit-identical (held in
the training dtype, no gradient, no optimizer state), the meta build equals a real build, and ``[lora]``
settings that cannot work are refused before launch.

``lora_run`` / ``held_values`` / ``initial_values`` are shared with tests/test_lora_parity.py.
"""

import json
import re

import pytest
import torch

from tessera.errors import ConfigError
from tessera.lora import LoRAConfig, add_lora, is_adapter_name
from tessera.models import Transformer
from tessera.models.init import materialize
from tessera.train.config import load_config, validate_config
from tessera.train.trainer import Trainer, meta_model
from tessera.zero import FullyShardedDataParallel

from test_trainer import tiny_args

CPU = torch.device("cpu")
STEPS = 4
LORA = ["--lora.rank=4", '--lora.targets=["wq", "wv", "wo", "w1", "w2"]', "--checkpoint.save_final=false",
        "--train.log_every=1", f"--train.eval_every={STEPS}"]


def lora_args(out, cache, name, extra=()):
    """A tiny LoRA job of STEPS steps, every step's loss logged (``--train.log_every=1``)."""
    return tiny_args(out, cache, steps=STEPS, extra=[*LORA, f"--run.name={name}", *extra])


def held_values(trainer) -> dict[str, torch.Tensor]:
    """Every parameter this rank's trainer holds, whole, by its single-process name (ZeRO-3: gathered, a
    collective; expert parallelism: local experts renamed by their global index)."""
    parts = getattr(trainer.engine, "parts", (trainer.engine,))
    if isinstance(parts[0], FullyShardedDataParallel):
        values = {n: t for e in parts for n, t in e.full_state().items()}
    else:
        values = {n: p.detach().clone() for n, p in trainer.core.named_parameters()}
    offsets = {f"{name}.experts.": m.expert_offset for name, m in trainer.core.named_modules()
               if hasattr(m, "expert_offset")}
    out = {}
    for n, t in values.items():
        prefix = next((p for p in offsets if n.startswith(p)), None)
        if prefix is not None:
            i, rest = n[len(prefix):].split(".", 1)
            n = f"{prefix}{offsets[prefix] + int(i)}.{rest}"
        out[n] = t
    return out


def initial_values(args) -> dict[str, torch.Tensor]:
    """The adapted model's initial values, built whole on the CPU (the single-process truth)."""
    cfg = load_config(None, args)
    model = Transformer(cfg.model, cfg.moe, seed=cfg.run.seed)
    add_lora(model, cfg.lora, cfg.run.seed)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def lora_run(args, world_size: int = 1) -> dict:
    """Train ``args`` as one rank of the current group; returns the summary, the logged train losses, the
    largest change of any base weight from its initial value (in the held dtype) and the adapters held."""
    cfg = validate_config(load_config(None, args), world_size)
    trainer = Trainer(cfg, CPU)
    try:
        summary = trainer.fit()
        held = held_values(trainer)
        dtypes = {n: t.dtype for n, t in held.items()}
    finally:
        trainer.close()
    init = initial_values(args)
    base = [n for n in held if not is_adapter_name(n)]
    base_change = max(float((held[n].float() - init[n].to(dtypes[n]).float()).abs().max()) for n in base)
    return {"summary": summary, "base_change": base_change, "base_dtypes": sorted({str(dtypes[n]) for n in base}),
            "adapters": {n: held[n].float() for n in held if is_adapter_name(n)}}


def lora_worker(rank, world_size, args):
    return lora_run(args, world_size)


def train_losses(run_dir, key: str = "loss") -> list[float]:
    """Every logged train step's ``key`` (loss, grad_norm) from the run's metrics.jsonl."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in lines if r["kind"] == "train"]


def adapter_count(args) -> int:
    return sum(t.numel() for n, t in initial_values(args).items() if is_adapter_name(n))


# ---- one process ------------------------------------------------------------------------------------


def test_only_adapters_train_and_base_weights_stay_bit_identical(tmp_path, corpus_cache):
    args = lora_args(tmp_path, corpus_cache, "one")
    out = lora_run(args)
    summary, n_adapter = out["summary"], adapter_count(args)
    assert summary["trainable_parameters"] == n_adapter < summary["parameters"] / 10
    assert out["base_change"] == 0.0  # every base weight (embedding, norms, linears, head) bit-identical
    init = initial_values(args)
    for name, value in out["adapters"].items():  # every adapter factor moved (B from zero)
        assert not torch.equal(value, init[name]), name
    losses = train_losses(tmp_path / "one")
    assert len(losses) == STEPS and summary["val_loss_end"] < summary["val_loss_start"]
    # the ledger: gradients and AdamW state (2 moments + a 0-d step per tensor) follow the adapters alone
    mem = summary["memory_per_rank"][0]
    n_tensors = sum(1 for n in init if is_adapter_name(n))
    assert mem["params"] == 4 * summary["parameters"]
    assert mem["grads"] == 4 * n_adapter
    assert mem["optimizer"] == 8 * n_adapter + 4 * n_tensors


def test_bf16_holds_base_weights_in_bf16_and_masters_only_for_adapters(tmp_path, corpus_cache):
    args = lora_args(tmp_path, corpus_cache, "bf16", extra=["--precision.dtype=bf16"])
    out = lora_run(args)
    summary, n_adapter = out["summary"], adapter_count(args)
    assert out["base_dtypes"] == ["torch.bfloat16"] and out["base_change"] == 0.0
    mem = summary["memory_per_rank"][0]
    assert mem["params"] == 2 * summary["parameters"]  # frozen and adapters alike in bf16, no fp32 copy
    # fp32 masters (4) + two fp32 moments (8) for the adapters only, plus 0-d steps
    assert 12 * n_adapter <= mem["optimizer"] < 12 * n_adapter + 64
    assert mem["grads"] == 2 * n_adapter  # bf16 gradient buckets of the adapters


def test_meta_build_equals_a_real_build(tmp_path, corpus_cache):
    cfg = load_config(None, lora_args(tmp_path, corpus_cache, "meta"))
    meta = meta_model(cfg)
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, CPU)
    real = Transformer(cfg.model, cfg.moe, seed=cfg.run.seed)
    adapted = add_lora(real, cfg.lora, cfg.run.seed)
    assert len(adapted) == 2 * 5  # 2 layers x wq, wv, wo, w1, w2
    got, want = dict(meta.named_parameters()), dict(real.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p), name
        assert got[name].requires_grad == p.requires_grad == is_adapter_name(name), name
    assert all(torch.equal(got[n], torch.zeros_like(got[n])) for n in got if n.endswith("lora_B.weight"))


def test_rank_zero_is_full_training(tmp_path, corpus_cache):
    cfg = load_config(None, tiny_args(tmp_path, corpus_cache))
    model = meta_model(cfg)
    assert cfg.lora == LoRAConfig() and all(p.requires_grad for p in model.parameters())
    assert not any(is_adapter_name(n) for n, _ in model.named_parameters())


@pytest.mark.parametrize("extra,message", [
    (["--lora.alpha=8"], "lora.alpha=8.0 has no effect in this job: it applies only with adapters (lora.rank > 0)"),
    (["--lora.rank=-1"], "lora.rank must be a non-negative integer"),
    (["--lora.rank=4", '--lora.targets=["gate"]'], "lora.targets has gate, which name no linear layer"),
    (["--lora.rank=4", "--lora.targets=[]"], "lora.targets is empty"),
    (["--lora.rank=4", "--lora.dropout=1.0"], "lora.dropout must be in [0, 1)"),
])
def test_impossible_lora_settings_are_refused_before_launch(tmp_path, corpus_cache, extra, message):
    cfg = load_config(None, tiny_args(tmp_path, corpus_cache, extra=extra))
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(cfg, cfg.run.nproc)


def test_zero3_frees_each_units_frozen_weights_after_its_backward():
    """ZeRO-3 keeps a unit's frozen flat for its backward (the input gradient needs W) and frees it as soon
    as that backward is over, so a LoRA backward holds about as many gathered units as a full one (here,
    with prefetch 1: the unit computing and the one after), not every frozen unit until backward ends."""
    from tessera.comm import CommGroup
    from tessera.models import model_config
    from tessera.models.layers import TransformerBlock
    from tessera.train.optim import OptimConfig, param_groups
    from tessera.zero import ZeroConfig
    from tessera.zero.build import wrap_policy

    with torch.device("meta"):
        model = Transformer(model_config("tiny", n_layers=6), seed=0)
    add_lora(model, LoRAConfig(rank=4, targets=["wq", "wv", "w2"]), seed=0)
    groups = param_groups(model, OptimConfig())
    policy = wrap_policy(ZeroConfig(), TransformerBlock, model)  # a unit per block, embedding and head
    engine = FullyShardedDataParallel(model, groups, lambda g: torch.optim.AdamW(g), CommGroup.single("dp_shard"),
                                      CommGroup.single("dp_replicate"), policy, CPU, prefetch=1)
    assert len(engine.frozen_flats) == len(engine.units) and len(engine.flats) == 6  # blocks mix both kinds
    assert all(f.shard.master is None and not f.full.requires_grad for f in engine.frozen_flats)
    assert all(s.master is not None for s in engine.update.shards)  # the optimizer sees adapters only
    assert sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]) == sum(
        f.size for f in engine.flats)
    frozen = [f for u in engine.units if not u.is_root for f in u.frozen]
    seen = []

    def count(*_):
        if torch._C._current_graph_task_id() != -1:  # inside backward
            seen.append(sum(f.gathered for f in frozen))

    for f in engine.flats:
        f.full.register_post_accumulate_grad_hook(count)
    x = torch.randint(0, 256, (2, 16))
    engine(x).float().logsumexp(-1).mean().backward()
    assert len(seen) == 6 and max(seen) <= 2, seen  # 8 units' frozen flats, at most 2 gathered at a time
    assert not any(f.gathered for f in engine.frozen_flats + engine.flats)  # all freed after backward
    assert not any(f.full.grad is not None for f in engine.frozen_flats)
