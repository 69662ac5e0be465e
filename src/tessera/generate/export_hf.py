"""``tessera export CHECKPOINT --format hf|peft [--merge-lora]``: a checkpoint of any layout as a Hugging
Face model folder, a PEFT adapter folder, or (``--merge-lora``) a LoRA run's merged model.

The checkpoint is consolidated into one whole one-process model (``run_model.checkpoint_model``; a LoRA
run's adapters merged into its base weights) and written by ``tessera.hf.save`` (``config.json`` +
``model.safetensors``, which ``AutoModelForCausalLM.from_pretrained`` loads); the run's ``tokenizer.json``
goes beside them when the run trained with one. A LoRA checkpoint holds adapters a Hugging Face Llama has
no place for, so its ``hf`` export needs ``--merge-lora`` (refused without, with the reason); ``peft``
writes its adapter alone (``adapter_config.json`` + ``adapter_model.safetensors``, ``tessera.lora.peft``),
which ``PeftModel.from_pretrained`` puts on the base model. ``--merge-lora`` with the default safetensors
format writes the merged model's parameters under tessera's names, as a full run's export would.
"""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file

from tessera.checkpoint.store import resolve
from tessera.errors import UserError
from tessera.generate.run_model import checkpoint_model, run_config, tokenizer_file

FORMATS = ("safetensors", "hf", "peft")


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the model of ``checkpoint`` (a checkpoint or a folder of them: the newest) to the Hugging
    Face folder ``out``, with its run's tokenizer files and its end-of-text id as ``eos_token_id``;
    returns ``out``. A LoRA run's model is written with its adapters merged."""
    import tessera.hf
    from tessera.train.data.tokenizer import load_tokenizer

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; the Hugging Face export writes a folder")
    model, cfg, _ = checkpoint_model(checkpoint)
    tokenizer_json = tokenizer_file(cfg.data.tokenizer)
    if tokenizer_json is not None and not tokenizer_json.is_file():
        raise UserError(f"the run's tokenizer {tokenizer_json} is missing; it cannot go with the export")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    try:
        out = tessera.hf.save(model, out, eos_token_id=int(tokenizer.eot))
        if tokenizer_json is not None:
            tokenizer.copy_files(str(out))
    except OSError as err:
        raise UserError(f"cannot write the export to {out} ({err.strerror or err})") from None
    return out


def export_peft(checkpoint: Path, out: str | Path) -> Path:
    """Write the adapters of LoRA checkpoint ``checkpoint`` as the PEFT folder ``out``; returns it."""
    from tessera.checkpoint.export import consolidate
    from tessera.lora import is_adapter_name
    from tessera.lora.peft import write_peft

    cfg = run_config(checkpoint)
    state, _ = consolidate(checkpoint)
    adapters = {name: t for name, t in state.items() if is_adapter_name(name)}
    try:
        return write_peft(adapters, cfg.lora, out, base_model=cfg.model_hf or None)
    except OSError as err:
        raise UserError(f"cannot write the export to {out} ({err.strerror or err})") from None


def export_merged_safetensors(checkpoint: Path, out: str | Path) -> Path:
    """Write the merged model of LoRA checkpoint ``checkpoint`` as one safetensors file of tessera's
    parameter names (a tied head once, as the embedding); returns it."""
    model, _, _ = checkpoint_model(checkpoint)
    out = Path(out)
    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"format": "pt", "source": checkpoint.name, "merged_lora": "true"})
        os.replace(tmp, out)
    except OSError as err:
        raise UserError(f"cannot write the merged model to {out} ({err.strerror or err})") from None
    return out


def _check_lora_flags(checkpoint: Path, fmt: str, merge_lora: bool) -> None:
    """UserError (one sentence) for a format or --merge-lora that does not fit what ``checkpoint`` holds."""
    lora = run_config(checkpoint).lora.enabled
    if merge_lora and fmt == "peft":
        raise UserError("--format peft writes the adapter alone; --merge-lora merges it into the base weights: "
                        "give one of them")
    if (merge_lora or fmt == "peft") and not lora:
        raise UserError(f"{checkpoint} holds no LoRA adapters (its run has lora.rank = 0), so there is nothing "
                        f"to {'merge' if merge_lora else 'write in PEFT format'}")
    if lora and fmt == "hf" and not merge_lora:
        raise UserError(f"{checkpoint} holds LoRA adapters, which a Hugging Face model folder has no place for: "
                        f"add --merge-lora to export the merged model, or use --format peft for the adapter alone")


def export_model_command(checkpoint: str | Path, out: str | Path | None, fmt: str, merge_lora: bool) -> int:
    """``tessera export`` with ``--format hf|peft`` or ``--merge-lora``: checks the flags against the
    checkpoint, writes ``out`` (default ``<checkpoint>-hf``, ``-peft`` or ``-merged.safetensors`` beside it),
    prints what it wrote; returns 0."""
    resolved = resolve(Path(checkpoint))
    if resolved is None:
        raise UserError(f"{checkpoint} is not a tessera checkpoint (runs/<name>/checkpoint or one step_<n> in it)")
    _check_lora_flags(resolved, fmt, merge_lora)
    suffix = {"hf": "-hf", "peft": "-peft", "safetensors": "-merged.safetensors"}[fmt]
    target = Path(out) if out is not None else resolved.with_name(resolved.name + suffix)
    if fmt == "safetensors":
        written = export_merged_safetensors(resolved, target)
        print(f"wrote {written} ({written.stat().st_size / 1e6:.1f} MB), the merged model weights of {resolved}")
        return 0
    written = export_hf(resolved, target) if fmt == "hf" else export_peft(resolved, target)
    files = ", ".join(sorted(p.name for p in written.iterdir()))
    what = "the Hugging Face model" if fmt == "hf" else "the PEFT LoRA adapter"
    merged = " (LoRA merged)" if merge_lora else ""
    print(f"wrote {written} ({files}), {what}{merged} of {resolved}")
    return 0
