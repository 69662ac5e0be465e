"""Parameter-server jobs over torch.distributed.rpc: 2 servers + 2 workers on the CTR model.

Few, shared jobs (each costs process start-up): one BSP run is the reference for parity, the AUC margin,
the bytes comparison and the resume test.
"""

import socket
import threading

import psutil
import pytest
import torch

from tessera.models.ctr import SPARSE_TABLES
from tessera.parameter_server import PSConfig, PSError, run_ps_job
from tessera.parameter_server.reference import train_single_process
from tessera.parameter_server.worker import build_model, click_log

STEPS = 30
# timeout: the RPC start-up of 4 spawned processes passed 20 s once on a loaded 2-core CI machine
BASE = dict(servers=2, workers=2, batch_size=64, fields=4, buckets=100, embed_dim=8, hidden=16,
            eval_size=2048, timeout=60.0)
AUC_MARGIN = 0.02  # ASP / SSP must reach the BSP run's AUC within this
pytestmark = pytest.mark.slow  # every test here starts server and worker processes


def listening_sockets() -> list[tuple[str, str, str, int]]:
    """(process, address, kind, port) of every listening socket of this process and its children: TCP
    listeners, and UNIX sockets bound to an address (TensorPipe's shm transport; port 0)."""
    found = []
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            conns = proc.net_connections("all")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.family in (socket.AF_INET, socket.AF_INET6) and c.status == psutil.CONN_LISTEN:
                found.append((str(proc.pid), c.laddr.ip, "tcp", c.laddr.port))
            elif c.family == socket.AF_UNIX and c.laddr:
                found.append((str(proc.pid), c.laddr, "unix", 0))
    return found


def run_watching_sockets(cfg: PSConfig, steps: int, from_step: int | None = None, **kw) -> tuple[dict, list]:
    """Run a job while a thread lists, every 20 ms, the listening sockets the job opened, as (process,
    address, kind): those that were not listening before it started, told apart by port too (this process
    may hold an earlier listener on the same address, e.g. a test's rendezvous store). ``from_step``: start
    looking only once worker 0 reports that step (skipping start-up, during which every role was seen to
    listen briefly on loopback as well); None: from the start, so no role is missed however late the progress
    callbacks arrive on a loaded machine."""
    seen: set = set()
    before = set(listening_sockets())
    done, go = threading.Event(), threading.Event()
    if from_step is None:
        go.set()

    def watch():
        while not done.is_set():
            if go.is_set():
                seen.update(s[:3] for s in listening_sockets() if s not in before)
            done.wait(0.02)

    def progress(step):
        if from_step is not None and step >= from_step:
            go.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run = run_ps_job(cfg, steps, seed=0, progress=progress, **kw)
    finally:
        done.set()
        watcher.join()
    return run, sorted(seen)


@pytest.fixture(scope="module")
def bsp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps_bsp")
    run, sockets = run_watching_sockets(PSConfig(mode="bsp", **BASE), STEPS, out_dir=str(out), want_params=True)
    run["listening"] = sockets
    return run


def test_bsp_equals_single_process_training(bsp_run):
    ref = train_single_process(PSConfig(mode="bsp", **BASE), STEPS, seed=0)
    for name, want in ref["params"].items():
        torch.testing.assert_close(bsp_run["params"][name], want, atol=2e-6, rtol=1e-5, msg=name)
    for step, loss in bsp_run["losses"].items():  # worker 0's half-batch loss is close to the global mean
        assert abs(loss - ref["losses"][step]) < 0.1
    assert bsp_run["auc"] == pytest.approx(ref["auc"], abs=1e-4)
    assert all(set(h) == {0} for h in bsp_run["staleness"])  # synchronous: every update fresh
    assert bsp_run["versions"] == [STEPS, STEPS]  # one averaged update per step on each server


@pytest.mark.parametrize("mode, slow", [("asp", 0.0), ("ssp", 0.05)])
def test_async_and_bounded_staleness_reach_the_synchronous_auc(bsp_run, mode, slow):
    """SSP with a deliberately slow last worker: the gap reaches the bound s and never exceeds it."""
    run = run_ps_job(PSConfig(mode=mode, staleness=2, **BASE), STEPS, seed=0, slow_last_worker=slow)
    assert run["auc"] > 0.6 and run["auc"] < run["ceiling_auc"]
    assert abs(run["auc"] - bsp_run["auc"]) < AUC_MARGIN
    assert run["versions"] == [STEPS * 2, STEPS * 2]  # every push applied on its own
    total = [sum(h.values()) for h in run["staleness"]]
    assert total == [STEPS * 2, STEPS * 2]
    if mode == "ssp":
        assert run["max_gap"] == 2  # the slow worker made the fast one hit the bound ...
    assert mode == "asp" or run["max_gap"] <= 2  # ... which it never exceeded


def test_sparse_push_pull_moves_only_touched_rows(bsp_run):
    """Measured bytes = exactly the touched rows (+ their ids) and the dense tensors, pulled and pushed."""
    cfg = PSConfig(**BASE)
    model, data = build_model(cfg, 0), click_log(cfg, 0)
    dense = [p for n, p in model.named_parameters() if n not in SPARSE_TABLES]
    dense_bytes = sum(p.numel() * 4 for p in dense)
    width = cfg.embed_dim + 1  # embed row + wide row
    expected = 0
    for step in range(STEPS):
        for w in range(cfg.workers):
            u = len(torch.unique(model.rows(data.batch(step, w, cfg.batch_size)[0])))
            # pull: ids (int64, per table) out, rows in; push: ids and gradient rows out; same for dense
            expected += 2 * (2 * 8 * u + 4 * width * u + 8 * len(dense) + dense_bytes)
    measured = sum(sum(b) for b in bsp_run["bytes_per_worker"].values())
    assert measured == expected
    # Per step through the busiest server vs a ring all-reduce of the same tables over the W workers.
    busiest = max(sum(b[s] for b in bsp_run["bytes_per_worker"].values()) for s in range(cfg.servers)) / STEPS
    def ring(buckets):
        return 2 * (cfg.workers - 1) / cfg.workers * (cfg.fields * buckets * width * 4 + dense_bytes)
    # the tables here are tiny (4 x 100 rows, nearly all touched): the PS moves more than a ring would ...
    assert busiest > ring(cfg.buckets) / 2
    # ... but its bytes are bounded by the B·F rows a batch can touch, whatever the table size
    bound = cfg.workers * 2 * (cfg.batch_size * cfg.fields * (16 + 4 * width) + 8 * len(dense) + dense_bytes)
    assert busiest <= bound < ring(10_000) / 10  # 4 x 10k-row tables: the sparse path moves >10x less


def test_killed_server_stops_workers_with_its_name_then_resume_matches(bsp_run, tmp_path):
    cfg = PSConfig(mode="bsp", save_every=4, **{**BASE, "timeout": 5.0})
    with pytest.raises(PSError, match="ps1") as err:
        # the slow worker (50 ms a step) keeps the job from finishing before the kill lands
        run_ps_job(cfg, STEPS, seed=0, out_dir=str(tmp_path), kill_server_at=(1, 10), slow_last_worker=0.05)
    # the spawner saw the server die: the job names it at once (its peers only see it vanish)
    assert str(err.value) == "ps1 was killed by signal SIGKILL, and the job stopped"
    resumed = run_ps_job(PSConfig(mode="bsp", resume=str(tmp_path / "tables"), **BASE), STEPS, seed=0,
                         want_params=True)
    assert 8 <= resumed["start_step"] < STEPS
    for name, want in bsp_run["params"].items():
        torch.testing.assert_close(resumed["params"][name], want, atol=1e-6, rtol=1e-6, msg=name)


def test_nothing_listens_beyond_the_configured_loopback_address(bsp_run):
    """ps.address = 127.0.0.1 (the default): every TCP listener of the job, the launching process's
    rendezvous store and each role's TensorPipe listeners, is on 127.0.0.1; none on 0.0.0.0 or ::."""
    tcp = [(pid, ip) for pid, ip, kind in bsp_run["listening"] if kind == "tcp"]
    assert {ip for _, ip in tcp} == {"127.0.0.1"}
    assert len({pid for pid, _ in tcp}) == 1 + 2 + 2  # the launcher, 2 servers, 2 workers all listen
    # the only other listeners: TensorPipe's shm transport, abstract UNIX sockets (this machine only)
    assert all(str(addr).startswith("\0") or str(addr).startswith("@")
               for _, addr, kind in bsp_run["listening"] if kind == "unix")


def test_the_listeners_follow_a_configured_network_address():
    from tessera.parameter_server.network import local_addresses

    others = [a for a in local_addresses() if not a.startswith("127.")]
    if not others:
        pytest.skip("this machine has no IPv4 address besides loopback")
    cfg = PSConfig(mode="bsp", address=others[0], **{**BASE, "eval_size": 256})
    run, sockets = run_watching_sockets(cfg, 4, from_step=1)
    assert run["versions"] == [4, 4]
    assert {ip for _, ip, kind in sockets if kind == "tcp"} == {others[0]}
