"""The whole model behind a path, in one process: a Hugging Face folder, or a tessera checkpoint of any
layout with its run's config and tokenizer.

A checkpoint ``runs/<name>/checkpoint/step_<n>`` (or its folder ``runs/<name>/checkpoint``: the newest
complete one) is consolidated by ``tessera.checkpoint.consolidate`` (what ``tessera export`` writes),
its model is described by the run's ``config.toml`` (``runs/<name>/config.toml``), built on the meta
device and handed the consolidated tensors, so every weight is allocated once. Generation and Hugging
Face export are one-device tools: this process holds the whole model.
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


def checkpoint_model(path: str | Path, moe_drop_tokens: bool | None = None) -> tuple[Transformer, object, Path]:
    """(whole model, run JobConfig, resolved checkpoint) of a checkpoint or a folder of them.
    ``moe_drop_tokens``: override the run's ``moe.drop_tokens`` (generation routes every token)."""
    path = Path(path)
    checkpoint = resolve(path) if path.is_dir() else None
    if checkpoint is None:
        raise UserError(f"{path} is neither a Hugging Face model folder (config.json) nor a tessera checkpoint "
                        f"(runs/<name>/checkpoint or one step_<n> in it)")
    cfg = run_config(checkpoint)
    moe = None
    if cfg.model.num_experts:
        moe = cfg.moe if moe_drop_tokens is None else dataclasses.replace(cfg.moe, drop_tokens=moe_drop_tokens)
    state, _ = consolidate(checkpoint)
    return whole_model(cfg.model, moe, state, checkpoint), cfg, checkpoint


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
