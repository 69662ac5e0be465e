"""Starting local processes: the one mechanism behind training ranks (``tessera.launch``), the
parameter server's server and worker roles and the planner's calibration ranks.

It is torch's elastic agent (what torchrun runs) run in this process: it starts ``nproc`` processes with
the spawn start method (forking after torch started threads can hang), gives each ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` in its environment (an entry derives its role
from its rank), watches them, and on the first failure stops the others, or restarts them all up to
``max_restarts`` times. It returns every process's return value by rank, or raises :class:`RankFailed`,
one sentence naming each process that failed.

What listens where. The agent's rendezvous store is hosted here, bound to ``address`` only (loopback
by default): a store the agent created itself would listen on every interface. While the agent runs, the
processes' own process groups are told to use a TCP store of their own instead of sharing the rendezvous
store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, read by the agent): with the shared store a restarted gloo
group failed to form in about half of the trials (pytorch/pytorch#135712); with its own, every restart
was clean (docs/FAULT_TOLERANCE.md). That store is torch's: a process that calls
``init_process_group`` as rank 0 hosts it on a free port of *every* interface (torch binds its server to
no address), and gloo's own connections bind to the address this machine's hostname resolves to. So a
training job's process group is reachable beyond loopback while it runs; the parameter server's roles
make no process group (their RPC listeners follow ``ps.address``, see ``tessera.parameter_server.network``).

This module imports torch and tessera.errors only, so that every layer may use it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable

from tessera.errors import ConfigError, UserError

LOOPBACK = "127.0.0.1"
USER_ERROR_EXIT = UserError.exit_code  # a process that stopped on the user's mistake


def rank_name(rank: int) -> str:
    return f"rank {rank}"


def process_rank() -> tuple[int, int]:
    """(rank, world size) of this process, as the agent set them."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def message_queue():
    """A queue spawned processes can put messages on for this one (pass it in ``args``): of the start
    method the processes are started with."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Queue()


class RankFailed(RuntimeError):
    """Spawned processes failed; the message names each (and how), ``exit_code`` is what the command
    should exit with (2 when every failed process stopped on a user error, else 1), ``exit_codes`` maps
    each failed rank to its exit code (negative: killed by that signal)."""

    def __init__(self, message: str, exit_code: int = 1, exit_codes: dict[int, int] | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.exit_codes = exit_codes or {}


def spawn(entry: Callable, nproc: int, args: tuple = (), *, max_restarts: int = 0, address: str = LOOPBACK,
          port: int = 0, name: Callable[[int], str] = rank_name) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``nproc`` new processes on this machine; returns {rank: return value}.

    ``entry`` must be a module-level function (it is pickled by name); it reads its rank with
    :func:`process_rank`. ``address:port`` is where the rendezvous store listens (port 0: a free one).
    ``name(rank)`` names a process in the failure sentence.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api

    # the agent logs each failed process's exit with a traceback of its own machinery, and torch's
    # spawner each process it stops; what matters is the process's own error, said once below
    with _quiet({"torch.distributed.elastic": logging.CRITICAL, "torch.multiprocessing": logging.ERROR}), \
            _rendezvous_store(address, port) as bound_port, _own_group_store():
        config = api.LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"tessera-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d", rdzv_endpoint=f"{_host(address)}:{bound_port}", rdzv_configs={"is_host": False},
            max_restarts=max_restarts, monitor_interval=0.2, start_method="spawn",
        )
        try:
            return api.elastic_launch(config, entry)(*args)
        except ChildFailedError as err:
            raise failure(err, name) from None


@contextmanager
def _quiet(levels: dict[str, int]):
    """While the agent runs: each named logger at the given level; the caller's levels come back after."""
    loggers = {logging.getLogger(n): level for n, level in levels.items()}
    before = {logger: logger.level for logger in loggers}
    try:
        for logger, level in loggers.items():
            logger.setLevel(level)
        yield
    finally:
        for logger, level in before.items():
            logger.setLevel(level)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address  # an IPv6 address in an endpoint needs brackets


@contextmanager
def _rendezvous_store(address: str, port: int):
    """A TCP store listening on ``address:port`` only, alive while the agent runs; yields its port. The
    agent joins it as a client (``is_host=False``)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    try:
        sock.bind((address, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {address}:{port} for the processes' rendezvous ({err.strerror}): "
                          f"choose another address or port") from None
    bound = sock.getsockname()[1]
    # the store owns the socket from here on (detach: Python must not close it under the store)
    store = dist.TCPStore(address, bound, None, True, timedelta(seconds=300), wait_for_workers=False,
                          master_listen_fd=sock.detach())
    try:
        yield bound
    finally:
        del store


@contextmanager
def _own_group_store():
    """While the agent runs: the processes' groups get a TCP store of their own (see the module doc)."""
    key, before = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def failure(err, name: Callable[[int], str] = rank_name) -> RankFailed:
    """One sentence for the processes in ``err.failures`` (rank -> failure with ``exitcode``). A process
    that raised an exception of its own has its traceback printed here (it printed nothing); one that
    exited with a code has said why itself."""
    codes = {rank: f.exitcode for rank, f in sorted(err.failures.items())}
    parts = []
    for rank, code in codes.items():
        parts.append(how_it_ended(name(rank), code))
        if code is None or code >= 0:
            _print_traceback(name(rank), err.failures[rank])
    said = " (its error is printed above)" if any(c is None or c >= 0 for c in codes.values()) else ""
    user_error = bool(codes) and all(code == USER_ERROR_EXIT for code in codes.values())
    return RankFailed(f"{', '.join(parts) or 'a process failed'}{said}",
                      USER_ERROR_EXIT if user_error else 1, codes)


def how_it_ended(who: str, exit_code: int | None) -> str:
    """``"<who> exited with code 1"``, or ``"<who> was killed by signal SIGKILL"`` for a negative code."""
    if exit_code is None or exit_code >= 0:
        return f"{who} exited with code {exit_code}"
    try:
        return f"{who} was killed by signal {signal.Signals(-exit_code).name}"
    except ValueError:
        return f"{who} was killed by signal {-exit_code}"


def _print_traceback(who: str, failure) -> None:
    """The traceback the agent recorded for a process that raised (none for one that exited by itself)."""
    message = getattr(failure, "message", None)
    stack = message.get("extraInfo", {}).get("py_callstack") if isinstance(message, dict) else None
    if stack:
        print(f"{who} raised:\n{stack.rstrip()}", file=sys.stderr, flush=True)
