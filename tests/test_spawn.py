"""tessera.spawn: the one way tessera starts local processes (training ranks, parameter-server roles,
calibration ranks). Results by rank; a failure is one sentence naming each failed process; nothing else
in src/ starts processes; the layers that use it import nothing above them."""

from __future__ import annotations

import ast
import os
import signal
import time
from pathlib import Path

import pytest

from tessera.errors import ConfigError
from tessera.spawn import RankFailed, process_rank, spawn

SRC = Path(__file__).resolve().parent.parent / "src" / "tessera"


def entry(mode: str):
    """Rank 0 (and every rank with mode "ok") returns; rank 1 fails as ``mode`` says."""
    rank, world = process_rank()
    if mode == "ok" or rank == 0 and mode == "ok0":
        return {"rank": rank, "world": world, "pid": os.getpid()}
    if rank == 1 and mode == "raise":
        raise ValueError("boom from rank 1")
    if rank == 1 and mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # the others wait until the spawner stops them


@pytest.mark.slow
def test_spawn_returns_every_processs_result_by_rank():
    got = spawn(entry, 2, ("ok",))
    assert sorted(got) == [0, 1]
    assert [(got[r]["rank"], got[r]["world"]) for r in (0, 1)] == [(0, 2), (1, 2)]
    assert len({r["pid"] for r in got.values()} | {os.getpid()}) == 3  # two new processes


@pytest.mark.slow
@pytest.mark.parametrize("mode, says", [
    ("raise", "worker1 exited with code 1 (its error is printed above)"),
    ("kill", "worker1 was killed by signal SIGKILL"),
])
def test_a_failed_process_stops_the_others_and_is_named_in_one_sentence(capfd, mode, says):
    start = time.monotonic()
    with pytest.raises(RankFailed) as err:
        spawn(entry, 2, (mode,), name=lambda rank: f"worker{rank}")
    assert time.monotonic() - start < 100  # rank 0 was stopped, not waited for
    assert str(err.value) == says and err.value.exit_code == 1
    assert err.value.exit_codes == {1: 1 if mode == "raise" else -signal.SIGKILL}
    printed = capfd.readouterr().err
    # a process that raised has its traceback printed (it printed nothing itself); a killed one has none
    assert ("ValueError: boom from rank 1" in printed) == (mode == "raise")


def test_a_rendezvous_port_in_use_is_a_config_error_before_any_process_starts():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"^cannot listen on 127.0.0.1:{port} for the processes' rendezvous"):
            spawn(entry, 2, ("ok",), port=port)


def test_spawn_quiets_torchs_loggers_only_while_it_runs(monkeypatch):
    import logging
    from contextlib import contextmanager

    from tessera import spawn as spawn_module

    names = ("torch.distributed.elastic", "torch.multiprocessing")
    seen = []

    @contextmanager
    def store_that_fails(address, port):  # what a port in use does, with the levels recorded inside
        seen.append([logging.getLogger(n).level for n in names])
        raise ConfigError("no store")
        yield port

    monkeypatch.setattr(spawn_module, "_rendezvous_store", store_that_fails)
    loggers = [logging.getLogger(n) for n in names]
    before = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.INFO)  # the caller's choice
        with pytest.raises(ConfigError, match="no store"):
            spawn(entry, 2, ("ok",))
        assert seen == [[logging.CRITICAL, logging.ERROR]]  # quiet while the agent would run
        assert [logger.level for logger in loggers] == [logging.INFO, logging.INFO]  # and given back
    finally:
        for logger, level in zip(loggers, before):
            logger.setLevel(level)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:  # "from tessera import comm": tessera.comm
            found |= {f"{node.module}.{a.name}" for a in node.names} if node.module == "tessera" else {node.module}
    return found


def test_nothing_else_in_src_starts_processes():
    """The test harness's persistent pool (tessera.testing) is the one other, on purpose."""
    starters = ("multiprocessing", "torch.multiprocessing", "subprocess", "torch.distributed.launcher.api",
                "torch.distributed.launcher", "torch.distributed.elastic.agent.server.local_elastic_agent")
    offenders = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if p.name != "spawn.py" and "testing" not in p.parts
                 and any(m == s or m.startswith(s + ".") for m in _imports(p) for s in starters)}
    assert offenders == set()


def test_spawn_and_the_parameter_server_import_nothing_above_them():
    assert {m for m in _imports(SRC / "spawn.py") if m.startswith("tessera")} == {"tessera.errors"}  # a leaf
    allowed = ("tessera.parameter_server", "tessera.comm", "tessera.topology", "tessera.models", "tessera.errors",
               "tessera.device", "tessera.spawn")
    for path in (SRC / "parameter_server").glob("*.py"):
        upward = {m for m in _imports(path) if m.startswith("tessera")
                  and not any(m == a or m.startswith(a + ".") for a in allowed)}
        assert upward == set(), path.name
