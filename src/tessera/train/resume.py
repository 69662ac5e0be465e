"""Resuming a run: where checkpoints live, what they hold besides tensors, and how a run continues.

A run's checkpoints are ``<run>/<checkpoint.folder>/step_<n>/`` (written atomically: see
:mod:`tessera.checkpoint`). Besides the model and optimizer tensors, each holds ``trainer.json``: the
step, the data sampler's position, the loss scaler, the part of the current metrics interval already
trained, and every rank's random-number-generator states — so a run resumed at the same layout repeats
the uninterrupted run's losses exactly. At another layout the tensors reshard and the data order stays
the same (it depends on the global batch, not on the ranks); only dropout masks, which are drawn per
rank, differ.

``<run>/progress.json`` is rewritten by rank 0 after every step; after a failure it tells the resumed
job how many steps the failed attempt had done past its last checkpoint (``steps_lost``).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import torch

from tessera import comm
from tessera.checkpoint import CheckpointError, latest, resolve, state_pieces, verify
from tessera.comm.group import CommGroup


def find_resume(resume: str, run_checkpoints: Path) -> Path | None:
    """The checkpoint to continue from: ``"auto"`` → the newest in this run's folder (None if there is
    none: a fresh start); a path → that checkpoint, or the newest inside a folder of checkpoints."""
    if not resume:
        return None
    if resume == "auto":
        return latest(run_checkpoints)
    found = resolve(Path(resume))
    if found is None:
        raise CheckpointError(f"checkpoint.resume: {resume} is neither a complete checkpoint nor a folder "
                              f"holding one")
    return found


# ---- random number generators -------------------------------------------------------------------


def _rng_tensor(device: torch.device) -> torch.Tensor:
    """This process's CPU generator state, then the accelerator's (if any), as one uint8 vector."""
    parts = [torch.get_rng_state()]
    if device.type != "cpu":
        parts.append(torch.get_device_module(device.type).get_rng_state(device))
    return torch.cat(parts)


def gather_rng_states(world: CommGroup, device: torch.device) -> list[str] | None:
    """Every rank's generator states, base64-encoded, on rank 0 (None elsewhere). Collective."""
    local = _rng_tensor(device).to(device)
    gathered = comm.gather(local, world, dst=0)
    if gathered is None:
        return None
    return [base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii") for t in gathered]


def restore_rng_state(states: list[str] | None, rank: int, device: torch.device) -> bool:
    """Set this rank's generators from a checkpoint written by a job of the same world size."""
    if not states or rank >= len(states):
        return False
    raw = torch.frombuffer(bytearray(base64.b64decode(states[rank])), dtype=torch.uint8)
    cpu_size = torch.get_rng_state().numel()
    torch.set_rng_state(raw[:cpu_size].clone())
    if device.type != "cpu" and raw.numel() > cpu_size:
        torch.get_device_module(device.type).set_rng_state(raw[cpu_size:].clone(), device)
    return True


# ---- progress of the current attempt ------------------------------------------------------------


def write_progress(run_dir: Path, step: int) -> None:
    """Rank 0, after every step: the last finished step (replaced atomically)."""
    tmp = run_dir / "progress.json.tmp"
    tmp.write_text(json.dumps({"step": step}), encoding="utf-8")
    os.replace(tmp, run_dir / "progress.json")


def read_progress(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "progress.json").read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError):
        return None


def restart_count() -> int:
    """Which attempt this is under torchrun's elastic agent (0: the first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def set_scheduler_step(scheduler, optimizer, step: int) -> None:
    """Put a LambdaLR where ``step`` calls of ``step()`` would have (its factor is a pure function of
    the step), and the optimizer's learning rates with it."""
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def check_before_launch(cfg) -> Path | None:
    """The checkpoint a job will resume from, checked in this one process before any rank starts:
    every file against the manifest (sizes and checksums), and every tensor the job will load present
    with its single-process shape: each trainable parameter of the configured model (a LoRA job's
    adapters only) and each piece of its optimizer's state (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``
    per parameter). Raises CheckpointError (one sentence naming the file and the tensor)."""
    from tessera.checkpoint.store import read_meta
    from tessera.lora import add_lora
    from tessera.lora.record import check_record
    from tessera.models import Transformer
    from tessera.train.optim import build_optimizer

    run_dir = Path(cfg.run.out_dir) / cfg.run.name if cfg.run.name else None
    if cfg.checkpoint.resume == "auto" and run_dir is None:
        return None
    path = find_resume(cfg.checkpoint.resume, (run_dir or Path(".")) / cfg.checkpoint.folder)
    if path is None:
        return None
    # the names and single-process shapes a load asks for: a model on the meta device allocates nothing
    # (and with the run's seed draws nothing from torch's generator). The ranks then load straight into
    # what each holds (``tessera.train.checkpoint``); no process ever builds the whole model.
    check_record(read_meta(path).get("lora"), cfg, path)  # the adapters' settings and base are this job's
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe, seed=cfg.run.seed)
    add_lora(model, cfg.lora, cfg.run.seed)  # a LoRA job loads its adapters only (the base is frozen)
    # the optimizer the trainer builds; its state keys and shapes are what a load asks for (sharded
    # engines hold the same tensors under the same single-process names, in slices)
    verify(path, state_pieces(model, build_optimizer(model, cfg.optim)))
    return path
