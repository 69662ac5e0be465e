"""Starting ranks: under torchrun this process is one rank; otherwise spawn local ranks through
:func:`tessera.spawn.spawn` (torch's elastic agent, the one torchrun uses, with a c10d rendezvous store on a
free loopback port; the ranks' process group, once formed, has rank 0 listening beyond loopback: see
``tessera.spawn`` for what listens where).

A rank whose call to a peer cannot complete (the peer died, or hung) prints one sentence naming the
rank, op and axis and exits with code 1; the agent then restarts every rank (up to ``run.max_restarts``
times, or torchrun's ``--max-restarts``) and the job resumes from its newest checkpoint when
``checkpoint.resume = "auto"``. See docs/FAULT_TOLERANCE.md."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.device import backend_for, resolve_device, set_device
from tessera.errors import CommError, UserError
from tessera.spawn import spawn


def under_torchrun() -> bool:
    """True when a launcher (torchrun or our own elastic launch) made this process a rank."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def run_rank(cfg) -> dict:
    """Train as one rank. Rank, world size and rendezvous come from the environment (a launcher's);
    without them this is a world of one, or whatever process group the caller already initialised."""
    from tessera.train.trainer import Trainer  # the training layer is imported only where it runs

    device = resolve_device(cfg.run.device, int(os.environ.get("LOCAL_RANK", "0")))
    set_device(device)
    if device.type == "cpu" and "LOCAL_WORLD_SIZE" in os.environ:
        # ranks on one machine share its cores (those this process may run on); oversubscribed threads
        # slow everyone down
        torch.set_num_threads(max(1, usable_cores() // int(os.environ["LOCAL_WORLD_SIZE"])))
    owns_group = env_world_size() > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend_for(device), timeout=timedelta(seconds=cfg.parallel.timeout_s))
    trainer = None
    try:
        trainer = Trainer(cfg, device)
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        if owns_group:
            dist.destroy_process_group()


def rank_entry(cfg) -> dict:
    """Entry point of a spawned rank: a user error becomes one sentence and exit code 2; a call to a peer
    that cannot complete becomes one sentence (it names the rank) and exit code 1, which an elastic agent
    answers by restarting the ranks."""
    try:
        return run_rank(cfg)
    except UserError as err:
        print(f"tessera: error (rank {os.environ.get('RANK', '0')}): {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
    except CommError as err:
        print(f"tessera: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from None


def launch_local(cfg, nproc: int) -> dict:
    """Spawn ``nproc`` ranks on this machine (tessera.spawn, restarting them up to ``run.max_restarts``
    times) and return rank 0's result."""
    return spawn(rank_entry, nproc, (cfg,), max_restarts=cfg.run.max_restarts)[0]
