"""Run a parameter-server job: S server and W worker processes over torch.distributed.rpc (TensorPipe).

The caller's process only spawns the roles (spawn context), relays progress and collects results; it
never joins the RPC group. RPC ranks 0..S-1 are servers ``ps0``.., ranks S..S+W-1 workers ``worker0``..;
they rendezvous over TCP on ``ps.address`` (loopback by default). A role that fails reports one line;
a role that dies is noticed by its peers within ``ps.timeout`` (their calls fail and name it), and the
job then stops every remaining process and raises :class:`PSError` with the most telling message.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import queue
import socket
import time
from pathlib import Path

import torch

from tessera.parameter_server.config import PSConfig
from tessera.parameter_server.errors import PSError, last_line

_CTX = mp.get_context("spawn")  # forking after torch started threads can hang


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _role_main(role: str, index: int, cfg: PSConfig, steps: int, seed: int, port: int, ckpt_dir: str,
               out_q, slow: float, want_params: bool) -> None:
    import torch.distributed.rpc as rpc

    from tessera.models.ctr import dense_names
    from tessera.parameter_server.server import ParameterServer, register
    from tessera.parameter_server.worker import build_model, worker_main

    torch.set_num_threads(1)
    name = f"ps{index}" if role == "server" else f"worker{index}"
    rank = index if role == "server" else cfg.servers + index
    try:
        if role == "server":  # registered before the rendezvous, so no worker can call it too early
            model = build_model(cfg, seed)
            register(ParameterServer(index, cfg, dict(model.named_parameters()), dense_names(model), ckpt_dir))
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{cfg.address}:{port}",
                                               rpc_timeout=cfg.timeout, num_worker_threads=max(16, 4 * cfg.workers))
        rpc.init_rpc(name, rank=rank, world_size=cfg.servers + cfg.workers, rpc_backend_options=opts)
    except Exception as err:  # noqa: BLE001
        out_q.put(("error", name, f"{name} could not start: {last_line(err)}"))
        return
    try:
        if role == "server":
            rpc.shutdown(graceful=True)  # serve until every role is done (the parent kills us on failure)
            out_q.put(("done", name, None))
            return
        report = (lambda step, loss: out_q.put(("step", name, (step, loss))))
        result = worker_main(index, cfg, steps, seed, report, slow if index == cfg.workers - 1 else 0.0,
                             want_params)
        out_q.put(("result", name, _pack(result)))
        rpc.shutdown(graceful=True)
    except Exception as err:  # noqa: BLE001
        out_q.put(("error", name, last_line(err)))
        try:
            rpc.shutdown(graceful=False)
        except RuntimeError:  # already torn down
            pass


def _pack(obj) -> bytes:
    """Tensors as plain bytes: a queue would pass them as shared-memory handles that die with the sender."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def run_ps_job(cfg: PSConfig, steps: int, seed: int = 0, out_dir: str = "", want_params: bool = False,
               kill_server_at: tuple[int, int] | None = None, slow_last_worker: float = 0.0,
               progress=None) -> dict:
    """Train the CTR model for ``steps`` steps; return worker 0's summary plus every worker's bytes.

    ``out_dir`` (optional) receives ``metrics.jsonl``, ``summary.json`` and the servers' tables under
    ``tables/`` (every ``ps.save_every`` steps and at the end). Test hooks: ``kill_server_at=(s, t)``
    SIGKILLs server s once worker 0 reported step t; ``slow_last_worker`` sleeps that many seconds per
    step on the last worker. ``progress(step)`` is called as worker 0 finishes each step.
    """
    cfg.validate()
    if cfg.resume:
        from tessera.parameter_server.server import latest_complete

        latest_complete(cfg.resume, cfg.servers)  # a bad folder is a ConfigError before anything starts
    port = cfg.port or free_port(cfg.address)
    ckpt_dir = str(Path(out_dir) / "tables") if out_dir else ""
    out_q = _CTX.Queue()
    procs = {}
    for role, count in (("server", cfg.servers), ("worker", cfg.workers)):
        for i in range(count):
            name = f"ps{i}" if role == "server" else f"worker{i}"
            procs[name] = _CTX.Process(target=_role_main, name=name, daemon=True, args=(
                role, i, cfg, steps, seed, port, ckpt_dir, out_q, slow_last_worker, want_params))
    for p in procs.values():
        p.start()
    try:
        results, losses = _collect(cfg, procs, out_q, kill_server_at, progress)
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    summary = dict(results["worker0"])
    summary["bytes_per_worker"] = {w: r["server_bytes"] for w, r in sorted(results.items())}
    summary["losses"] = losses
    summary["examples_per_s"] = (steps - summary["start_step"]) * cfg.workers * cfg.batch_size / max(
        max(r["seconds"] for r in results.values()), 1e-9)
    if out_dir:
        _write(Path(out_dir), cfg, summary)
    return summary


def _collect(cfg, procs, out_q, kill_server_at, progress):
    results, losses, errors, done = {}, {}, [], set()
    first_death = None
    last_news = time.monotonic()
    patience = 2 * cfg.timeout + 60  # no message for this long: something hangs that no timeout caught
    while len(results) < cfg.workers or len(done) < cfg.servers:
        try:
            kind, name, payload = out_q.get(timeout=0.2)
            last_news = time.monotonic()
        except queue.Empty:
            kind = None
        if kind == "step":
            step, loss = payload
            if name == "worker0":
                losses[step] = loss
                if progress:
                    progress(step)
                if kill_server_at and step >= kill_server_at[1] and procs[f"ps{kill_server_at[0]}"].is_alive():
                    procs[f"ps{kill_server_at[0]}"].kill()
        elif kind == "result":
            results[name] = torch.load(io.BytesIO(payload), weights_only=False)
        elif kind == "done":
            done.add(name)
        elif kind == "error":
            errors.append(payload)
            break
        dead = [n for n, p in procs.items() if p.exitcode not in (None, 0) and n not in done]
        if dead and first_death is None:
            first_death = time.monotonic()
        # a dead process: give its peers up to one timeout to notice and say so (their message is clearer)
        if first_death is not None and time.monotonic() - first_death > cfg.timeout + 5:
            raise PSError(f"process {dead[0]} exited with code {procs[dead[0]].exitcode} and no peer reported why")
        if time.monotonic() - last_news > patience:
            raise PSError(f"the parameter-server job made no progress for {patience:g} s")
    if errors:
        raise PSError(errors[0])
    return results, losses


def _write(out: Path, cfg: PSConfig, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step, loss in sorted(summary["losses"].items()):
            f.write(json.dumps({"step": step, "loss_worker0": loss}) + "\n")
    keep = {k: v for k, v in summary.items() if k not in ("params", "losses")}
    keep["staleness"] = [{str(k): v for k, v in h.items()} for h in summary.get("staleness", [])]
    keep["config"] = vars(cfg)
    (out / "summary.json").write_text(json.dumps(keep, indent=2, default=str), encoding="utf-8")
