"""``tessera export CHECKPOINT --format hf``: a checkpoint of any layout as a Hugging Face model folder.

The checkpoint is consolidated into one whole one-process model (``run_model.checkpoint_model``) and
written by ``tessera.hf.save`` (``config.json`` + ``model.safetensors``, which
``AutoModelForCausalLM.from_pretrained`` loads); the run's ``tokenizer.json`` goes beside them when the
run trained with one.
"""

from __future__ import annotations

from pathlib import Path

from tessera.checkpoint.store import resolve
from tessera.errors import UserError
from tessera.generate.run_model import checkpoint_model, tokenizer_file


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the model of ``checkpoint`` (a checkpoint or a folder of them: the newest) to the Hugging
    Face folder ``out``, with its run's tokenizer files and its end-of-text id as ``eos_token_id``;
    returns ``out``."""
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


def export_hf_command(checkpoint: str | Path, out: str | Path | None = None) -> int:
    """Prints what it wrote; returns 0. ``out`` defaults to ``<checkpoint>-hf`` beside the checkpoint."""
    resolved = resolve(Path(checkpoint))
    if resolved is None:
        raise UserError(f"{checkpoint} is not a tessera checkpoint (runs/<name>/checkpoint or one step_<n> in it)")
    target = Path(out) if out is not None else resolved.with_name(resolved.name + "-hf")
    written = export_hf(resolved, target)
    files = ", ".join(sorted(p.name for p in written.iterdir()))
    print(f"wrote {written} ({files}), the Hugging Face model of {resolved}")
    return 0
