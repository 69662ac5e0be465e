"""Run a parameter-server job: S server and W worker processes over torch.distributed.rpc (TensorPipe).

The caller's process starts the roles with :func:`tessera.spawn.spawn` (process rank r < S is server
``ps<r>``, the others are workers ``worker0``..), relays their progress and collects their results; it
never joins the RPC group. The roles find each other through a FileStore in a temporary folder; their
RPC listeners bind to the interface of ``ps.address`` (loopback by default, see ``network``), and the
spawner's rendezvous store to ``ps.address:ps.port``. A role that fails reports one line and exits 1; a
role that dies is seen by the spawner at once. The spawner then stops every process and the job raises
:class:`PSError` with the most telling message: the role that was killed, else the first error a role
reported (a worker names the server that failed to answer it).
"""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch

from tessera.parameter_server.config import PSConfig
from tessera.parameter_server.errors import PSError, last_line
from tessera.parameter_server.network import bind_rpc_to, listen_interface
from tessera.spawn import RankFailed, how_it_ended, message_queue, process_rank, spawn


def role_name(servers: int, rank: int) -> str:
    return f"ps{rank}" if rank < servers else f"worker{rank - servers}"


def _role_main(cfg: PSConfig, steps: int, seed: int, ifname: str, store: str, ckpt_dir: str, out_q,
               slow: float, want_params: bool) -> bytes | None:
    """One role's process (a tessera.spawn entry). Returns a worker's result packed as bytes (a server:
    None); a failure is reported on ``out_q`` in one line and ends the process with exit code 1."""
    import torch.distributed.rpc as rpc

    from tessera.models.ctr import dense_names
    from tessera.parameter_server.server import ParameterServer, register
    from tessera.parameter_server.worker import build_model, worker_main

    rank, world = process_rank()
    name, index = role_name(cfg.servers, rank), rank if rank < cfg.servers else rank - cfg.servers
    torch.set_num_threads(1)
    out_q.put(("up", name, os.getpid()))
    try:
        if rank < cfg.servers:  # registered before the rendezvous, so no worker can call it too early
            model = build_model(cfg, seed)
            register(ParameterServer(index, cfg, dict(model.named_parameters()), dense_names(model), ckpt_dir))
        bind_rpc_to(ifname)
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", rpc_timeout=cfg.timeout,
                                               num_worker_threads=max(16, 4 * cfg.workers))
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    except Exception as err:  # noqa: BLE001
        out_q.put(("error", name, f"{name} could not start: {last_line(err)}"))
        raise SystemExit(1) from None
    try:
        if rank < cfg.servers:
            rpc.shutdown(graceful=True)  # serve until every role is done (the spawner stops us on failure)
            return None
        report = (lambda step, loss: out_q.put(("step", name, (step, loss))))
        result = _pack(worker_main(index, cfg, steps, seed, report, slow if index == cfg.workers - 1 else 0.0,
                                   want_params))
        rpc.shutdown(graceful=True)
        return result
    except Exception as err:  # noqa: BLE001
        out_q.put(("error", name, last_line(err)))
        try:
            rpc.shutdown(graceful=False)
        except RuntimeError:  # already torn down
            pass
        raise SystemExit(1) from None


def _pack(obj) -> bytes:
    """A worker's result (tensors, numbers, strings, lists and dicts of them) as bytes, read back with
    ``torch.load(weights_only=True)``, which builds nothing else."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def run_ps_job(cfg: PSConfig, steps: int, seed: int = 0, out_dir: str = "", want_params: bool = False,
               kill_server_at: tuple[int, int] | None = None, slow_last_worker: float = 0.0,
               progress=None, interface: tuple[str, str] | None = None) -> dict:
    """Train the CTR model for ``steps`` steps; return worker 0's summary plus every worker's bytes.

    ``out_dir`` (optional) receives ``metrics.jsonl``, ``summary.json`` and the servers' tables under
    ``tables/`` (every ``ps.save_every`` steps and at the end). Test hooks: ``kill_server_at=(s, t)``
    SIGKILLs server s once worker 0 reported step t; ``slow_last_worker`` sleeps that many seconds per
    step on the last worker. ``progress(step)`` is called as worker 0 finishes each step. ``interface``:
    ``network.listen_interface(cfg.address)`` when the caller looked it up already (its pre-flight).
    """
    cfg.validate()
    if cfg.resume:
        from tessera.parameter_server.server import latest_complete

        latest_complete(cfg.resume, cfg.servers)  # a bad folder is a ConfigError before anything starts
    ifname, address = interface or listen_interface(cfg.address)  # likewise an address of no interface here
    ckpt_dir = str(Path(out_dir) / "tables") if out_dir else ""
    relay = _Relay(cfg, message_queue(), kill_server_at, progress)
    with tempfile.TemporaryDirectory(prefix="tessera-ps-") as tmp:
        args = (cfg, steps, seed, ifname, os.path.join(tmp, "rpc_store"), ckpt_dir, relay.out_q, slow_last_worker,
                want_params)
        relay.start()
        try:
            returned = spawn(_role_main, cfg.servers + cfg.workers, args, address=address, port=cfg.port,
                             name=partial(role_name, cfg.servers))
        except RankFailed as err:
            raise PSError(relay.explain(err)) from None
        finally:
            relay.finish()
    results = {role_name(cfg.servers, r): torch.load(io.BytesIO(v), weights_only=True)
               for r, v in sorted(returned.items()) if r >= cfg.servers}
    summary = dict(results["worker0"])
    summary["bytes_per_worker"] = {w: r["server_bytes"] for w, r in sorted(results.items())}
    summary["losses"] = relay.losses
    summary["examples_per_s"] = (steps - summary["start_step"]) * cfg.workers * cfg.batch_size / max(
        max(r["seconds"] for r in results.values()), 1e-9)
    if out_dir:
        _write(Path(out_dir), cfg, summary)
    return summary


class _Relay(threading.Thread):
    """In the launching process, while the roles run: reads their messages (a role's process id, worker 0's
    loss per step, a role's error), calls ``progress``, kills a server for the test hook, and kills every
    role when none said anything for longer than any timeout allows (something hangs that none caught)."""

    def __init__(self, cfg: PSConfig, out_q, kill_server_at, progress):
        super().__init__(daemon=True)
        self.out_q, self.kill_server_at, self.progress = out_q, kill_server_at, progress
        self.patience, self.servers = 2 * cfg.timeout + 60, cfg.servers
        self.pids: dict[str, int] = {}
        self.losses: dict[int, float] = {}
        self.errors: list[str] = []
        self.stalled = False
        self._done = threading.Event()

    def run(self) -> None:
        last_news = time.monotonic()
        while not self._done.is_set():
            try:
                self._handle(*self.out_q.get(timeout=0.2))
                last_news = time.monotonic()
            except queue.Empty:
                if time.monotonic() - last_news > self.patience and not self.stalled:
                    self.stalled = True
                    self._kill(*self.pids)

    def finish(self) -> None:
        """Stop reading, after the messages already sent (a role's last error may still be queued)."""
        self._done.set()
        self.join()
        while True:
            try:
                self._handle(*self.out_q.get(timeout=0.1))
            except queue.Empty:
                return

    def _handle(self, kind: str, name: str, payload) -> None:
        if kind == "up":
            self.pids[name] = payload
        elif kind == "error":
            self.errors.append(payload)
        elif kind == "step" and name == "worker0":
            step, loss = payload
            self.losses[step] = loss
            if self.progress:
                self.progress(step)
            if self.kill_server_at and step >= self.kill_server_at[1] and self._kill(f"ps{self.kill_server_at[0]}"):
                self.kill_server_at = None

    def _kill(self, *names: str) -> bool:
        """SIGKILL the named roles; False when one has not said its process id yet."""
        for name in names:
            if name not in self.pids:
                return False
            try:
                os.kill(self.pids[name], signal.SIGKILL)
            except ProcessLookupError:  # already gone
                pass
        return True

    def explain(self, err: RankFailed) -> str:
        """The sentence for a failed job: a stall, else the roles killed by a signal (the cause: a role's
        peers only see it vanish), else the first error a role reported, else how the roles exited."""
        if self.stalled:
            return f"the parameter-server job made no progress for {self.patience:g} s"
        killed = [how_it_ended(role_name(self.servers, r), code) for r, code in sorted(err.exit_codes.items())
                  if code is not None and code < 0]
        if killed:
            return f"{', '.join(killed)}, and the job stopped"
        return self.errors[0] if self.errors else str(err)


def _write(out: Path, cfg: PSConfig, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step, loss in sorted(summary["losses"].items()):
            f.write(json.dumps({"step": step, "loss_worker0": loss}) + "\n")
    keep = {k: v for k, v in summary.items() if k not in ("params", "losses")}
    keep["staleness"] = [{str(k): v for k, v in h.items()} for h in summary.get("staleness", [])]
    keep["config"] = vars(cfg)
    (out / "summary.json").write_text(json.dumps(keep, indent=2, default=str), encoding="utf-8")
