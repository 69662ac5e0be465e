"""Starting ranks: under torchrun this process is one rank; otherwise spawn local ranks through torch's
elastic launcher (the same agent torchrun uses, with a c10d rendezvous on a free local port).

A rank whose call to a peer cannot complete (the peer died, or hung) prints one sentence naming the
rank, op and axis and exits with code 1; the agent then restarts every rank (up to ``run.max_restarts``
times, or torchrun's ``--max-restarts``) and the job resumes from its newest checkpoint when
``checkpoint.resume = "auto"``. See docs/FAULT_TOLERANCE.md."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.device import backend_for, resolve_device, set_device
from tessera.errors import CommError, UserError


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
    """Spawn ``nproc`` ranks on this machine and return rank 0's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the agent logs each failed rank's exit with a traceback of its own machinery; the rank's own
    # error is what matters, and the rank prints it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"tessera-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=cfg.run.max_restarts,
        monitor_interval=0.2, start_method="spawn",
    )
    try:
        with _own_rendezvous_store():
            results = elastic_launch(config, rank_entry)(cfg)
    except ChildFailedError as err:
        raise _failure(err) from None
    return results[0]


@contextmanager
def _own_rendezvous_store():
    """While the agent runs: the ranks' group gets a TCP store of its own instead of sharing the
    rendezvous's. With the shared store a restarted gloo group failed to form in about half of the
    trials (pytorch/pytorch#135712); with this variable, read by the agent, every restart was clean."""
    key, before = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


class RankFailed(RuntimeError):
    """A spawned rank exited with an error; the message names each failed rank and why."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def _failure(err) -> RankFailed:
    """One sentence for the ranks that failed; each rank has already printed its own error."""
    codes = {rank: failure.exitcode for rank, failure in sorted(err.failures.items())}
    which = ", ".join(f"rank {rank} exited with code {code}" for rank, code in codes.items())
    user_error = all(code == UserError.exit_code for code in codes.values())
    return RankFailed(f"{which or 'a rank failed'} (its error is printed above)",
                      UserError.exit_code if user_error else 1)
