"""Persistent pools of gloo ranks, so multi-rank tests cost milliseconds instead of a process-group start.

A :class:`RankPool` spawns ``world_size`` worker processes once (``spawn`` context, one CPU thread each)
that join a gloo process group through a ``FileStore`` in a temporary folder, with an explicit timeout.
:meth:`RankPool.run` sends ``fn`` (a module-level function, pickled by reference) and its params to every
worker, which calls ``fn(rank, world_size, **params)``; the return values come back as a list indexed by
rank. Failures are reported fast, with every failing rank's traceback (:class:`RankFailure`); a rank that
hangs past the call's deadline raises :class:`RankTimeout`. Whenever a rank hangs or a worker dies, the
pool is poisoned: hung workers' stacks are dumped (SIGUSR1 + faulthandler), all workers are killed, and
the next call starts new ones. :class:`PoolManager` keeps one pool per world size for a test session.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # noqa: F401 - registers its atexit hook before ours (see _close_live_pools)
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from tessera.testing._worker import read_stacks, request_stacks, worker_main

__all__ = ["PoolManager", "RankFailure", "RankPool", "RankTimeout"]

_CTX = multiprocessing.get_context("spawn")  # forking after torch started threads can hang
_LIVE_POOLS: set = set()  # strong refs: an unreferenced pool's workers still run until closed


class RankFailure(RuntimeError):
    """One or more ranks raised, died or did not report. The message holds every failing rank's traceback.

    Attributes: ``failures`` rank -> traceback text; ``exceptions`` rank -> the exception object where it
    could be pickled; ``missing`` ranks that never reported; ``dead`` rank -> worker exit code.
    """

    def __init__(self, message: str, failures=None, exceptions=None, missing=(), dead=None):
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.exceptions: dict[int, BaseException] = dict(exceptions or {})
        self.missing: tuple[int, ...] = tuple(missing)
        self.dead: dict[int, int | None] = dict(dead or {})


class RankTimeout(RankFailure):
    """Some ranks did not finish before the call's deadline (and none raised or died)."""


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class RankPool:
    """``world_size`` persistent gloo ranks. Not thread-safe: one ``run`` at a time."""

    failure_grace_s = 3.0  # after a first failure, how long to wait for the other ranks to report

    def __init__(self, world_size: int, pg_timeout_s: float = 60.0, start_timeout_s: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self.generation = 0  # how many times workers were started; grows when a poisoned pool is replaced
        self._owner_pid = os.getpid()
        self._procs: list = []
        self._task_qs: list = []
        self._result_q = None
        self._tmpdir: str | None = None
        self._task_id = 0
        self._closed = False
        _LIVE_POOLS.add(self)
        self._start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._tmpdir, f"stacks-rank{rank}.txt")

    def _start(self) -> None:
        ws = self.world_size
        self._tmpdir = tempfile.mkdtemp(prefix=f"tessera-pool{ws}-")
        self._result_q = _CTX.Queue()
        self._task_qs = [_CTX.Queue() for _ in range(ws)]
        store = os.path.join(self._tmpdir, "store")
        self._procs = [
            _CTX.Process(
                target=worker_main,
                args=(r, ws, store, self.pg_timeout_s, self._task_qs[r], self._result_q, self._stack_path(r)),
                name=f"tessera-rank{r}-of-{ws}",
            )
            for r in range(ws)
        ]
        try:
            for p in self._procs:
                p.start()
        except BaseException:
            self._kill()
            raise
        self.generation += 1
        ready, errors, dead = set(), {}, {}
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while len(ready) < ws and not errors and not dead and time.monotonic() < deadline:
                try:
                    kind, _, rank, payload = self._result_q.get(timeout=0.1)
                except queue.Empty:
                    exited = {r: p.exitcode for r, p in enumerate(self._procs) if r not in ready and not p.is_alive()}
                    if exited and self._result_q.empty():  # an exited worker's last words are read first
                        dead = exited
                    continue
                if kind == "ready":
                    ready.add(rank)
                else:
                    errors[rank] = payload
        except BaseException:  # Ctrl-C or pytest-timeout
            self._kill()
            raise
        if len(ready) == ws:
            return
        missing = [r for r in range(ws) if r not in ready and r not in errors and r not in dead]
        lines = [f"could not start a pool of {ws} gloo ranks (start_timeout_s={self.start_timeout_s})"]
        lines += [f"--- rank {r} failed to join the process group ---\n{text}" for r, text in errors.items()]
        lines += [f"--- rank {r} died (exit code {code}) ---" for r, code in dead.items()]
        lines += [f"--- ranks {missing} did not join in time ---"] if missing else []
        lines += self._dump_stacks(missing)
        self._kill()
        cls = RankFailure if errors or dead else RankTimeout
        raise cls("\n".join(lines), failures=errors, missing=missing, dead=dead)

    def run(self, fn: Callable, *, timeout: float = 120.0, **params: Any) -> list:
        """Run ``fn(rank, world_size, **params)`` on every rank; return the results indexed by rank."""
        if self._closed:
            raise RuntimeError("this RankPool is closed")
        try:
            payload = pickle.dumps((fn, params), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"cannot send {fn!r} to the ranks: it must be a module-level function of an importable "
                f"module and every param must be picklable ({type(exc).__name__}: {exc})"
            ) from exc
        if not self._procs or not all(p.is_alive() for p in self._procs):
            for r, p in enumerate(self._procs):
                if not p.is_alive():
                    print(f"tessera rank pool: rank {r} of {self.world_size} exited (exit code {p.exitcode}); "
                          f"restarting the pool\n{self._read_stacks(r)}", file=sys.stderr)
            self._kill()
            self._start()
        self._task_id += 1
        task_id, ws = self._task_id, self.world_size
        for q in self._task_qs:
            q.put((task_id, list(sys.path), payload))

        start = time.monotonic()
        try:
            results, failures, exceptions, dead, pending = self._collect(task_id, start + timeout)
        except BaseException:  # Ctrl-C or pytest-timeout while ranks run: never leave a task running
            self._kill()
            raise
        if not pending and not failures and not dead:
            return [results[r] for r in range(ws)]

        missing = sorted(pending)
        elapsed = time.monotonic() - start
        timed_out = not failures and not dead
        if timed_out:
            head = f"ranks {missing} of {ws} did not finish {_fn_name(fn)} within timeout={timeout} s"
        else:
            bad = sorted(set(failures) | set(dead))
            head = f"ranks {bad} of {ws} failed in {_fn_name(fn)} (after {elapsed:.1f} s)"
        lines = [head]
        for r in sorted(failures):
            lines.append(f"--- rank {r} raised ---\n{failures[r].rstrip()}")
        for r in sorted(dead):
            lines.append(f"--- rank {r} died: worker exited with exit code {dead[r]} ---")
            lines += [self._read_stacks(r)] if self._read_stacks(r) else []  # faulthandler's crash report
        if missing:
            why = "timed out" if timed_out else f"gave no answer within {self.failure_grace_s} s of the failure"
            lines.append(f"--- ranks {missing} did not report ({why}) ---")
            lines += self._dump_stacks(missing)
        if missing or dead:  # hung or dead ranks leave the process group unusable: replace the pool
            lines.append("(the pool was replaced: all its workers were killed)")
            self._kill()
        cls = RankTimeout if timed_out else RankFailure
        raise cls("\n".join(lines), failures=failures, exceptions=exceptions, missing=missing, dead=dead)

    def _collect(self, task_id: int, deadline: float):
        """Wait for every rank's answer; stop early when a rank fails or dies (after the grace period)."""
        results, failures, exceptions, dead = {}, {}, {}, {}
        pending, grace_end = set(range(self.world_size)), None

        def receive(wait: float) -> bool:
            try:
                kind, msg_task, rank, data = self._result_q.get(timeout=wait)
            except queue.Empty:
                return False
            if msg_task != task_id or rank not in pending:
                return True  # stale: cannot happen with poisoning, but never mix up tasks
            pending.discard(rank)
            if kind == "ok":
                try:
                    results[rank] = pickle.loads(data)
                except BaseException:
                    failures[rank] = "the return value could not be unpickled here:\n" + traceback.format_exc()
                return True
            failures[rank], exc_bytes = data
            try:
                exceptions[rank] = pickle.loads(exc_bytes)
            except BaseException:  # None, or a class that only rebuilds in the worker
                pass
            return True

        while pending:
            end = deadline if grace_end is None else min(deadline, grace_end)
            now = time.monotonic()
            if now >= end:
                break
            if not receive(min(0.05, end - now)):
                exited = [r for r in pending if not self._procs[r].is_alive()]
                while exited and receive(0.05):  # what it said before exiting comes first
                    pass
                dead.update({r: self._procs[r].exitcode for r in exited if r in pending})
                pending -= dead.keys()
            if (failures or dead) and grace_end is None:
                grace_end = time.monotonic() + self.failure_grace_s
        return results, failures, exceptions, dead, pending

    def _read_stacks(self, rank: int) -> str:
        return read_stacks(self._stack_path(rank))

    def _dump_stacks(self, ranks: list[int]) -> list[str]:
        """Ask hung workers for their Python stacks (faulthandler on SIGUSR1), echo them to stderr."""
        stacks = request_stacks({r: self._procs[r] for r in ranks}, self._stack_path)
        lines = [f"--- stacks of rank {r} (pid {self._procs[r].pid}) ---\n{text}" for r, text in stacks.items()]
        if lines:
            print(f"tessera rank pool (world size {self.world_size}): hung ranks:\n" + "\n".join(lines),
                  file=sys.stderr, flush=True)
        return lines

    def _kill(self) -> None:
        """Terminate, then kill, every worker; drop queues and the temporary folder."""
        self._procs = [p for p in self._procs if p.pid is not None]  # started ones only
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for q in [*self._task_qs, self._result_q]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._procs, self._task_qs, self._result_q, self._tmpdir = [], [], None, None

    def close(self, wait_s: float = 5.0) -> None:
        """Ask the workers to leave the process group and exit; kill those that do not within ``wait_s``."""
        if os.getpid() != self._owner_pid:  # a forked child must not touch its parent's workers
            return
        self._closed = True
        _LIVE_POOLS.discard(self)
        started = [(p, q) for p, q in zip(self._procs, self._task_qs) if p.pid is not None]
        for p, q in started:
            if p.is_alive():
                q.put(None)
        deadline = time.monotonic() + wait_s
        for p, _ in started:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()


class PoolManager:
    """One :class:`RankPool` per world size, started on first use (the ``rank_pool`` test fixture)."""

    def __init__(self, pg_timeout_s: float = 60.0, start_timeout_s: float = 120.0):
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self._pools: dict[int, RankPool] = {}

    def pool(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size, self.pg_timeout_s, self.start_timeout_s)
        return self._pools[world_size]

    def run(self, fn: Callable, world_size: int, *, timeout: float = 120.0, **params: Any) -> list:
        """Run ``fn(rank, world_size, **params)`` on ``world_size`` ranks; results indexed by rank."""
        return self.pool(world_size).run(fn, timeout=timeout, **params)

    def close_all(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


@atexit.register
def _close_live_pools() -> None:
    # atexit runs hooks last-in first-out, and multiprocessing.util (imported above) registered its own,
    # which joins non-daemonic children, before this one: so workers are gone before it waits on them.
    # Workers are not daemonic because daemonic processes may not start children (DataLoader workers).
    for pool in list(_LIVE_POOLS):
        pool.close(wait_s=2.0)
