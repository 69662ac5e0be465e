"""Worker side of the rank pool (see ``rank_pool.py``): one spawned process per rank.

Each worker joins a gloo process group once, then loops: take a task from its own queue, run
``fn(rank, world_size, **params)``, put the outcome on the shared result queue, clean up, repeat.
Messages to the parent are tuples ``(kind, task_id, rank, payload)``:

* ``("ready", None, rank, pid)``            the process group is up
* ``("start_error", None, rank, text)``     joining the process group failed (traceback text)
* ``("ok", task_id, rank, bytes)``          the pickled return value
* ``("error", task_id, rank, (text, bytes | None))``  traceback text, pickled exception (None if unpicklable)

Payloads are pickled here, explicitly: ``multiprocessing.Queue.put`` pickles in a feeder thread where an
error would be printed and lost instead of reported. Stacks travel through a file per rank that the
worker's faulthandler writes (on SIGUSR1, or on a fatal signal); ``read_stacks`` and ``request_stacks``
are the parent's half of that.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback


def _die_with_parent() -> None:
    """Linux only: have the kernel SIGKILL this worker when the parent dies, even by SIGKILL (a CI runner
    killing pytest). The signal fires when the *thread* that started us exits, so pools should be created
    from the main thread (pytest does). Best effort: elsewhere the idle loop polls the parent instead."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - exotic libc
        pass


def _loopback_interface() -> str | None:
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:  # pragma: no cover
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def _pickled_exception(exc: BaseException) -> bytes | None:
    """The exception pickled, if it survives a round trip (many custom exceptions do not)."""
    try:
        data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
        return data
    except BaseException:
        return None


def _run_task(rank: int, world_size: int, task_id: int, sys_path: list, payload: bytes) -> tuple:
    for entry in sys_path:  # test folders imported by the parent after we started
        if entry not in sys.path:
            sys.path.append(entry)
    try:
        fn, params = pickle.loads(payload)
        result = fn(rank, world_size, **params)
    except BaseException as exc:  # also pytest outcomes (skip/fail) and SystemExit: report them all
        return ("error", task_id, rank, (traceback.format_exc(), _pickled_exception(exc)))
    try:
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        text = f"the return value ({type(result).__name__}) could not be pickled:\n" + traceback.format_exc()
        return ("error", task_id, rank, (text, None))
    return ("ok", task_id, rank, data)


def _cleanup(torch, dist) -> None:
    """Undo what a task may leave behind so tasks stay independent and the worker does not leak.

    torch has no public way to list process groups, so we read ``distributed_c10d._world.pg_map``
    (private; stable from torch 2.0 to 2.13). Access is guarded: if it moves, groups leak (costing
    sockets and threads) but tests keep working. Errors from destroying a group do propagate: the
    worker then exits and the parent replaces the pool on the next call.
    """
    try:
        from torch.distributed import distributed_c10d as c10d

        default = c10d._get_default_group()
        groups = [pg for pg in list(c10d._world.pg_map) if pg is not default]
    except Exception:
        groups = []
    for pg in groups:
        dist.destroy_process_group(pg)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def read_stacks(path: str) -> str:
    """What a worker's faulthandler wrote: stacks asked for with SIGUSR1, or a fatal-signal report."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def request_stacks(procs: dict, path_of, wait_s: float = 2.0) -> dict[int, str]:
    """Parent side: send SIGUSR1 to the live workers in ``procs`` (rank -> Process), return rank -> stacks."""
    signalled = []
    for rank, proc in procs.items():
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGUSR1)
                signalled.append(rank)
            except OSError:
                pass
    if not signalled:
        return {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(read_stacks(path_of(r)) for r in signalled):
        time.sleep(0.05)
    time.sleep(0.1)  # let the last lines land
    return {r: read_stacks(path_of(r)) for r in signalled}


def worker_main(rank, world_size, store_path, pg_timeout_s, task_q, result_q, stack_path) -> None:
    """Entry point of a spawned worker process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it kills us at exit
    # Stacks go to a file, not stderr: our fd 2 is whatever pytest was capturing when we were spawned.
    stack_file = open(stack_path, "w", buffering=1)  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.enable(file=stack_file, all_threads=True)  # fatal signals (segfaults) -> file
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)  # parent asks for a dump
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # pragma: no cover - already set
            pass
        loopback = _loopback_interface()
        if loopback is not None:  # all ranks live on this host: no need to resolve the hostname
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:
        result_q.put(("start_error", None, rank, traceback.format_exc()))
        return
    result_q.put(("ready", None, rank, os.getpid()))

    parent = multiprocessing.parent_process()
    while True:
        try:
            message = task_q.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                break
            continue
        if message is None:
            break
        result_q.put(_run_task(rank, world_size, *message))
        try:
            _cleanup(torch, dist)
        except BaseException:  # the parent notices the exit on its next call, shows this and restarts
            stack_file.write("cleanup after a task failed:\n" + traceback.format_exc())
            _exit(70, result_q, stack_file)
    try:
        dist.destroy_process_group()
    except Exception:  # pragma: no cover - leaving anyway
        pass
    _exit(0, result_q, stack_file)


def _exit(code: int, result_q, stack_file) -> None:
    """Flush our messages, then skip interpreter teardown (about 1 s per worker with torch loaded)."""
    result_q.close()
    result_q.join_thread()
    for stream in (sys.stdout, sys.stderr, stack_file):
        stream.flush()
    os._exit(code)
