"""A planner layout as ``tessera train`` runs it: the flags that run it, and the trainer's own rule on them.

The search keeps a layout only if ``tessera train`` accepts the flags printed for it: they are parsed by
the trainer's loader (``tessera.train.config.load_config``) and judged by its validation
(``validate_config``: the pairings of ``tessera.composition`` plus every degree, shape and divisibility
check). The planner holds no copy of that rule, so it follows the trainer as pairings become trainable.

The mapping, layout → settings (``dry_run.planner_layout`` is its inverse):

    dp          parallel.dp_replicate (DDP) or parallel.dp_shard (ZeRO: state sharded over dp)
    pp, tp, cp, ep, zero_stage      parallel.<same>
    (model) lora_rank, lora_targets lora.rank, lora.targets      (a LoRA job: lora_rank > 0)
    sp          tensor_parallel.sequence_parallel            (tp > 1)
    schedule    pipeline.schedule; m = global_batch / (dp·micro_batch) → pipeline.microbatches;
                virtual_stages → pipeline.virtual_stages      (pp > 1)
    micro_batch data.micro_batch_size;  recompute → checkpointing.mode;  offload → zero.offload
                (True: host memory; "disk": files)
"""

from __future__ import annotations

import dataclasses
import json

from tessera.errors import ConfigError
from tessera.planner.memory import offload_kind

PRECISION_DTYPE = {"mixed": "bf16", "fp32": "fp32"}  # the planner's precision → precision.dtype


def parallel_degrees(layout) -> dict:
    """The ParallelConfig degrees and ZeRO stage of ``layout`` (ZeRO shards its state over dp: dp_shard)."""
    sharded = layout.zero_stage > 0
    return {"dp_replicate": 1 if sharded else layout.dp, "dp_shard": layout.dp if sharded else 1, "pp": layout.pp,
            "tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "zero_stage": layout.zero_stage}


def layout_settings(layout, global_batch: int) -> dict:
    """``"section.key" -> value`` that make the trainer run ``layout`` on ``layout.world`` ranks: every key
    the layout decides (defaults included, so a caller can compare them with a config it already has)."""
    out = {f"parallel.{axis}": degree for axis, degree in parallel_degrees(layout).items()}
    if layout.tp > 1:
        out["tensor_parallel.sequence_parallel"] = layout.sp
    if layout.pp > 1:
        out["pipeline.schedule"] = layout.schedule
        out["pipeline.microbatches"] = layout.microbatches(global_batch)
        out["pipeline.virtual_stages"] = layout.virtual_stages
    out["data.micro_batch_size"] = layout.micro_batch
    out["checkpointing.mode"] = layout.recompute
    if layout.zero_stage > 0:
        out["zero.offload"] = offload_setting(layout.offload)
    return out


def offload_setting(offload):
    """A layout's ``offload`` as the value of ``zero.offload``: the default for none, "disk" for disk, and
    host offload as the key spells it (``true``, or "host" where the key is a word)."""
    from tessera.zero.config import ZeroConfig

    default, kind = ZeroConfig().offload, offload_kind(offload)
    if kind == "none":
        return default
    return kind if kind == "disk" or not isinstance(default, bool) else True


def as_flags(settings: dict) -> list[str]:
    """``--section.key=value`` for each setting that differs from the trainer's default (booleans in
    lower case, lists in JSON, as the loader reads them)."""
    from tessera.train.config import SECTIONS

    flags = []
    for key, value in settings.items():
        section, name = key.split(".")
        if section != "model" and getattr(SECTIONS[section](), name) == value:
            continue
        text = str(value).lower() if isinstance(value, bool) else json.dumps(value) if isinstance(value, list) \
            else value
        flags.append(f"--{key}={text}")
    return flags


def model_settings(spec, seq: int) -> dict:
    """The trainer's model for a catalogue ``ModelSpec``: its preset when the spec is a tessera preset's,
    else the shapes over the default preset (tessera's decoder is Llama-style: a ``gpt`` spec becomes a
    Llama-style model of the same sizes, which the validity rule judges the same way); a LoRA spec's
    adapters as the ``[lora]`` keys."""
    from tessera.models.config import PRESETS

    from tessera.planner.catalog import from_model_config

    preset = spec.name.removeprefix("tessera-")
    adapters = {"lora_rank": spec.lora_rank, "lora_targets": spec.lora_targets}
    if preset in PRESETS and spec == dataclasses.replace(
            from_model_config(spec.name, PRESETS[preset], top_k=spec.top_k), **adapters):
        out = {"model.preset": preset}
        if seq > spec.seq:
            out["model.max_seq_len"] = seq
    else:
        out = {"model.vocab_size": spec.vocab, "model.dim": spec.hidden, "model.n_layers": spec.layers,
               "model.n_heads": spec.heads, "model.n_kv_heads": spec.kv_heads, "model.ffn_hidden_dim": spec.ffn,
               "model.max_seq_len": max(seq, spec.seq), "model.tie_embeddings": spec.tied}
        if spec.experts > 1:
            out.update({"model.num_experts": spec.experts, "model.moe_every": spec.moe_every})
    if spec.experts > 1:
        out["moe.top_k"] = spec.top_k
    if spec.lora_rank:
        out.update({"lora.rank": spec.lora_rank, "lora.targets": list(spec.lora_targets)})
    return out


def job_flags(spec, global_batch: int, seq: int, precision: str) -> list[str]:
    """The flags every layout of one plan shares: model, batch, sequence length and precision."""
    settings = {**model_settings(spec, seq), "data.global_batch_size": global_batch, "data.seq_len": seq,
                "precision.dtype": PRECISION_DTYPE[precision]}
    return as_flags(settings)


def train_refusal(flags: list[str], world: int) -> str | None:
    """None when ``tessera train`` accepts ``flags`` on ``world`` ranks, else its one-sentence reason."""
    from tessera.train.config import load_config, validate_config

    try:
        validate_config(load_config(None, flags), world)
    except ConfigError as err:
        return str(err)
    return None


class TrainerRule:
    """``rule(layout)`` is None when ``tessera train`` runs ``layout`` of one plan (common ``flags``: see
    :func:`job_flags`), else the trainer's reason; the search calls it on each candidate."""

    def __init__(self, flags: list[str], global_batch: int):
        self.flags, self.global_batch = list(flags), global_batch

    def layout_flags(self, layout) -> list[str]:
        return as_flags(layout_settings(layout, self.global_batch))

    def __call__(self, layout) -> str | None:
        return train_refusal(self.flags + self.layout_flags(layout), layout.world)
