"""The whole model behind a path, in one process: a Hugging Face folder, or a tessera checkpoint of any
layout with its run's config and tokenizer.

A checkpoint ``runs/<name>/checkpoint/step_<n>`` (or its folder ``runs/<name>/checkpoint``: the newest
complete one) is consolidated by ``tessera.checkpoint.consolidate`` (what ``tessera export`` writes),
its model is described by the run's ``config.toml`` (``runs/<name>/config.toml``), built on the meta
device and handed the consolidated tensors, so every weight is allocated once. Generation and Hugging
Face export are one-device tools: this process holds the whole model. A LoRA run's checkpoint holds its
adapters only: its model is the run's base model with those adapters, merged into the base weights.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.checkpoint.export import consolidate
from tessera.checkpoint.store import resolve
from tessera.errors import ConfigError, UserError
from tessera.kernels.apply import apply_kernels
from tessera.models.llama import Transformer


@dataclass
class RunModel:
    """A whole model, where it came from, and what tokenises its text."""

    model: Transformer
    tokenizer: object  # vocab_size, eot, encode(text) -> np.ndarray, decode(ids) -> str
    stop_ids: tuple[int, ...]  # ids that end a generation (the tokenizer's eot, config.json's eos)
    tokenizer_file: Path | None  # the tokenizer.json it uses, if any (copied by the Hugging Face export)
    source: Path
    # a Hugging Face folder's prompt is encoded as transformers does (its BOS and the like); a tessera run's as
    # its training documents were (no special tokens)
    prompt_special_tokens: bool = False

    def encode_prompt(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=self.prompt_special_tokens)]


def whole_model(cfg, moe, state: dict[str, torch.Tensor], source: Path) -> Transformer:
    """A Transformer of ``cfg`` (and ``moe``) holding ``state`` (single-process names; a tied head may be
    absent), built on the meta device so nothing is allocated twice. ConfigError if they do not match."""
    from tessera.hf.convert import check_tensors

    with torch.device("meta"):
        model = Transformer(cfg, moe, seed=0)  # nothing allocated; the seed is never drawn from
    check_tensors(model, {name: tuple(t.shape) for name, t in state.items()}, source)
    state = dict(state)
    if cfg.tie_embeddings:  # one tensor: the checkpoint may hold the embedding only
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, assign=True)
    model._tie()  # assign gave the head and the embedding separate Parameters; make them one again
    model.init_buffers(torch.device("cpu"))
    return model


def run_config(checkpoint: Path):
    """The JobConfig of the run that wrote ``checkpoint`` (``<run>/<checkpoint.folder>/step_<n>``)."""
    from tessera.train.config import NON_TRANSFORMER_PRESETS, load_config

    toml = checkpoint.parent.parent / "config.toml"
    if not toml.is_file():
        raise UserError(f"{toml} is missing: the checkpoint {checkpoint} needs its run's config.toml to "
                        f"describe the model")
    cfg = load_config(str(toml))
    if cfg.model_preset in NON_TRANSFORMER_PRESETS:
        raise UserError(f"the run of {checkpoint} trained the {cfg.model_preset!r} model, not a decoder")
    return cfg


def adapted_model(cfg, checkpoint: Path) -> Transformer:
    """The whole model of a LoRA run (``lora.rank`` > 0) in one process, adapters not merged: the base
    weights are the run's initial values (its ``model.hf`` folder, or its seed), built as the trainer
    builds them (``meta_model``), and the adapters are the checkpoint's (a LoRA checkpoint holds nothing
    else). fp32, on the CPU."""
    from tessera.models.init import materialize
    from tessera.train.checkpoint import load_model
    from tessera.train.trainer import meta_model

    if cfg.model_hf and not Path(cfg.model_hf).is_dir():
        raise UserError(f"the base model {cfg.model_hf} of the LoRA run of {checkpoint} is missing; its "
                        f"checkpoints hold the adapters only")
    from tessera.checkpoint.store import read_meta
    from tessera.lora.record import check_record

    check_record(read_meta(checkpoint).get("lora"), cfg, checkpoint)  # the base is the one it was trained on
    model = meta_model(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, init_from="")))
    materialize(model, torch.device("cpu"), torch.float32)
    load_model(checkpoint, model)  # the trainable parameters: the adapters
    return model


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names (itself, or the newest in a folder of them); UserError if none."""
    path = Path(path)
    checkpoint = resolve(path) if path.is_dir() else None
    if checkpoint is None:
        raise UserError(f"{path} is neither a Hugging Face model folder (config.json) nor a tessera checkpoint "
                        f"(runs/<name>/checkpoint or one step_<n> in it)")
    return checkpoint


def checkpoint_model(path: str | Path, moe_drop_tokens: bool | None = None) -> tuple[Transformer, object, Path]:
    """(whole model, run JobConfig, resolved checkpoint) of a checkpoint or a folder of them; a LoRA run's
    adapters merged into its base weights (``tessera.lora.merge``), so the model is an ordinary one.
    ``moe_drop_tokens``: override the run's ``moe.drop_tokens`` (generation routes every token). The run's
    ``[kernels]`` rms_norm and gqa choices are applied, so decoding computes as training did."""
    model, cfg, checkpoint = _checkpoint_model(path, moe_drop_tokens)
    return apply_kernels(model, cfg.kernels), cfg, checkpoint


def _checkpoint_model(path, moe_drop_tokens):
    """checkpoint_model's result before the run's [kernels] choices are applied."""
    checkpoint = find_checkpoint(path)
    cfg = run_config(checkpoint)
    if moe_drop_tokens is not None:
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, drop_tokens=moe_drop_tokens))
    if cfg.lora.enabled:
        from tessera.lora.merge import merge_lora

        model = adapted_model(cfg, checkpoint)
        merge_lora(model)
        return model, cfg, checkpoint
    state, _ = consolidate(checkpoint)
    return whole_model(cfg.model, cfg.moe if cfg.model.num_experts else None, state, checkpoint), cfg, checkpoint


def tokenizer_file(spec: str) -> Path | None:
    return None if spec == "byte" else Path(spec).expanduser() / "tokenizer.json"


def _hf_eos(folder: Path) -> tuple[int, ...]:
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def load_run_model(path: str | Path, device: torch.device = torch.device("cpu")) -> RunModel:
    """The model, tokenizer and stop ids behind ``path`` (a Hugging Face folder or a tessera checkpoint),
    on ``device``, ready to decode. UserError (one sentence) for a path that is neither."""
    import tessera.hf

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist")
    if (path / "config.json").is_file():
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"{path} holds no tokenizer.json, so its text cannot be tokenised")
        model = tessera.hf.load(path)
        spec, extra_stops = str(path), _hf_eos(path)
    else:
        model, cfg, _ = checkpoint_model(path, moe_drop_tokens=False)
        spec, extra_stops = cfg.data.tokenizer, ()
    from tessera.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise UserError(f"the tokenizer of {path} has {tokenizer.vocab_size} tokens, more than the model's "
                        f"vocabulary of {model.cfg.vocab_size}")
    eot = getattr(tokenizer, "eot", None)
    stops = tuple(dict.fromkeys(([] if eot is None else [int(eot)]) + list(extra_stops)))
    return RunModel(model.to(device), tokenizer, stops, tokenizer_file(spec), path,
                    prompt_special_tokens=(path / "config.json").is_file())
