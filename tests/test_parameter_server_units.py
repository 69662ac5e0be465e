"""Parameter-server pieces in one process: row-wise optimizers vs torch's, AUC, click log, config."""

import re

import pytest
import torch

from tessera.errors import ConfigError
from tessera.parameter_server import ClickLog, PSConfig, auc
from tessera.parameter_server.row_optim import RowOptimizer


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("dense", [False, True])
def test_row_optimizer_equals_torch(name, dense):
    """Updating only touched rows equals torch's optimizer on a sparse (or dense) gradient."""
    torch.manual_seed(0)
    table = torch.randn(20, 3)
    ref = table.clone().requires_grad_()
    if name == "adam":
        opt = torch.optim.Adam([ref], lr=0.1) if dense else torch.optim.SparseAdam([ref], lr=0.1)
    else:
        opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[name]([ref], lr=0.1)
    mine = RowOptimizer(name, table, lr=0.1, dense=dense)
    for step in range(4):
        rows = torch.arange(20) if dense else torch.tensor([1, 5, 7 + step, 19])
        grad = torch.randn(len(rows), 3)
        full = torch.zeros(20, 3).index_add_(0, rows, grad)
        ref.grad = full if dense else torch.sparse_coo_tensor(rows[None], grad, (20, 3))
        opt.step()
        mine.apply(rows, grad)
    torch.testing.assert_close(table, ref.detach(), atol=1e-6, rtol=1e-6)


def test_auc_matches_pair_counting():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (60,), generator=g).float()  # many ties
    labels = torch.bernoulli(torch.full((60,), 0.4), generator=g)
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    pairs = (pos[:, None] > neg[None]).float() + 0.5 * (pos[:, None] == neg[None]).float()
    assert auc(scores, labels) == pytest.approx(pairs.mean().item())


def test_click_log_is_deterministic_and_has_a_ceiling():
    log = ClickLog(4, 100, seed=3)
    f1, y1 = log.batch(5, 1, 32)
    f2, y2 = log.batch(5, 1, 32)
    assert torch.equal(f1, f2) and torch.equal(y1, y2) and f1.max() < 100
    assert not torch.equal(f1, log.batch(5, 0, 32)[0])
    fields, labels, ceiling = log.eval_set(4096)
    assert 0.75 < ceiling < 1.0  # the planted model is informative but noisy
    assert 0.1 < labels.mean() < 0.6


@pytest.mark.parametrize("kw, message", [
    ({"mode": "sync"}, "ps.mode must be one of bsp, asp, ssp"),
    ({"servers": 0}, "ps.servers must be at least 1"),
    ({"optimizer": "lamb"}, "ps.optimizer"),
    ({"fields": 0}, "ctr.n_fields"),
])
def test_config_validation(kw, message):
    with pytest.raises(ConfigError, match=message):
        PSConfig(**kw).validate()


def test_resume_from_a_folder_without_tables_is_a_config_error(tmp_path):
    from tessera.parameter_server import run_ps_job

    with pytest.raises(ConfigError, match="no complete set of tables"):
        run_ps_job(PSConfig(resume=str(tmp_path)), steps=1)


def test_the_cli_refuses_a_resume_folder_without_tables_before_making_the_run_folder(tmp_path, capsys):
    from tessera.cli import main

    runs = tmp_path / "runs"
    for mode in (["--dry-run"], []):  # the dry run checks it as the run does
        assert main(["train", "--model.preset=ctr", f"--ps.resume={tmp_path}", f"--run.out_dir={runs}", *mode]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tessera: error: ") and "no complete set of tables" in err and "\n" not in err
    assert not runs.exists()


# ---- what a worker may ask of a server over RPC ----

class _Spy:
    """Stands in for a server and records every attribute looked up on it."""

    name = "ps_spy"

    def __init__(self):
        object.__setattr__(self, "touched", [])

    def __getattribute__(self, attr):
        if attr != "touched":
            object.__getattribute__(self, "touched").append(attr)
        return object.__getattribute__(self, attr)

    def start_step(self):
        return 7

    def load(self, folder):  # a real server method that no worker may call
        raise AssertionError("called")


@pytest.mark.parametrize("method", ["__class__", "__init__", "load", "load_state", "save", "_apply", "_wait",
                                    "tables", 3])
def test_rpc_refuses_a_method_outside_the_allow_list_without_looking_it_up(monkeypatch, method):
    from tessera.parameter_server import server as ps_server
    from tessera.parameter_server.errors import PSError

    spy = _Spy()
    monkeypatch.setitem(ps_server._SERVERS, "ps_spy", spy)
    with pytest.raises(PSError) as err:
        ps_server.serve_call("ps_spy", method, "/tmp/somewhere")
    assert str(err.value).startswith("parameter server ps_spy refused the RPC method ")
    assert "workers may call only final_state, pull, push, start_step" in str(err.value)
    assert "\n" not in str(err.value)
    assert spy.touched == []  # refused before anything of the server was looked up, let alone called
    assert ps_server.serve_call("ps_spy", "start_step") == 7  # an allowed method goes through ...
    assert spy.touched == ["start_step"]
    with pytest.raises(PSError, match="no parameter server named 'ps9'"):  # ... to a server this process hosts
        ps_server.serve_call("ps9", "start_step")


def test_the_allow_list_is_exactly_what_the_client_calls():
    import inspect

    from tessera.parameter_server import client
    from tessera.parameter_server.server import RPC_METHODS, ParameterServer

    called = set(re.findall(r'self\._call\("(\w+)"', inspect.getsource(client.PSClient)))
    assert called == RPC_METHODS
    assert all(callable(getattr(ParameterServer, m)) for m in RPC_METHODS)


# ---- where the RPC listens ----

def test_the_listening_interface_follows_the_configured_address():
    from tessera.parameter_server.network import interface_address, listen_interface, local_addresses

    name, address = listen_interface("127.0.0.1")
    assert address == "127.0.0.1" and interface_address(name) == "127.0.0.1"
    assert listen_interface("localhost")[1] == "127.0.0.1"  # a name is resolved
    for other in local_addresses():  # every interface's own address maps back to it
        assert interface_address(listen_interface(other)[0]) == other


@pytest.mark.parametrize("address, says", [
    ("0.0.0.0", "means every interface"),
    ("198.51.100.7", "is not the (first) IPv4 address of any network interface"),
    ("no-such-host.invalid", "does not resolve"),
])
def test_an_address_no_interface_holds_is_refused_before_anything_starts(tmp_path, capsys, address, says):
    from tessera.cli import main
    from tessera.parameter_server.network import listen_interface, local_addresses

    assert address not in local_addresses()
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        listen_interface(address)
    assert str(err.value).startswith(f"ps.address '{address}' ") and "\n" not in str(err.value)
    for mode in (["--dry-run"], []):  # the CLI's pre-flight: a dry run refuses it as the run does
        assert main(["train", "--model.preset=ctr", f"--ps.address={address}", f"--run.out_dir={tmp_path}",
                     *mode]) == 2
        assert capsys.readouterr().err.strip() == f"tessera: error: {err.value}"
    assert not any(tmp_path.iterdir())  # refused before any folder was made


def test_validating_the_ps_section_looks_nothing_up(monkeypatch):
    """Every job validates [ps] (a DDP job too): that must not depend on this machine's network."""
    import socket

    from tessera.train.config import load_config, validate_config

    def no_network(*args, **kwargs):
        raise AssertionError("a network look-up during validation")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "if_nameindex", no_network)
    PSConfig(address="198.51.100.7").validate()  # no interface holds it: the job that listens refuses it
    validate_config(load_config(None, ["--model.preset=tiny", "--data.seq_len=32"]), 1)
    validate_config(load_config(None, ["--model.preset=ctr", "--ps.address=198.51.100.7"]), 1)
