"""What a LoRA checkpoint is relative to: its adapter settings and the base weights they were trained on.

A LoRA checkpoint holds the adapters alone; the frozen base weights come back from the run's initial values
(its ``run.seed``, or its ``model.hf`` folder). So a checkpoint records both, and a resume, an export or a
generation refuses a job whose adapters (rank, alpha, targets) or base differ: the tensors would load, and the
result would silently be another model.

The base of a ``model.hf`` job is identified by a digest of each safetensors file's size, header and first
and last MiB of data: cheap (a few MiB read however large the model), and it changes when the folder holds
other weights (a different model of the same shapes differs in its first bytes).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tessera.errors import ConfigError

_SAMPLE = 1 << 20  # bytes read at each end of a file's data


def _folder_digest(folder: Path) -> str:
    from tessera.hf.safetensors_file import shard_files

    digest = hashlib.sha256()
    for file in shard_files(folder):
        size = file.stat().st_size
        with open(file, "rb") as f:
            digest.update(f"{file.name}/{size}".encode())
            digest.update(f.read(_SAMPLE))  # the header and the first weights
            f.seek(max(0, size - _SAMPLE))
            digest.update(f.read(_SAMPLE))
    return digest.hexdigest()[:16]


def adapter_record(cfg) -> dict | None:
    """The record a LoRA job's checkpoints carry (None without adapters): ``cfg`` is the JobConfig."""
    lora = cfg.lora
    if not lora.enabled:
        return None
    base = {"hf": _folder_digest(Path(cfg.model_hf))} if cfg.model_hf else {"seed": cfg.run.seed}
    return {"rank": lora.rank, "alpha": float(lora.alpha), "targets": sorted(lora.targets), "base": base}


def check_record(saved: dict | None, cfg, checkpoint: Path) -> None:
    """ConfigError (one sentence) unless checkpoint ``checkpoint``'s record ``saved`` is the job ``cfg``'s."""
    want = adapter_record(cfg)
    if saved == want or want is None or saved is None:  # full ↔ LoRA mismatches are refused by the tensors
        return
    for key in ("rank", "alpha", "targets"):
        if saved.get(key) != want[key]:
            raise ConfigError(f"the checkpoint {checkpoint} holds adapters with lora.{key}={saved.get(key)!r}, but "
                              f"this job has lora.{key}={want[key]!r}")
    what = "model.hf folder's weights" if "hf" in want["base"] else "run.seed (the base weights' initial values)"
    raise ConfigError(f"the checkpoint {checkpoint} holds adapters trained on another base model: its {what} "
                      f"differ from this job's; resume with the base it was trained on")
