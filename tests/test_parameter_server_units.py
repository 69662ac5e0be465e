"""Parameter-server pieces in one process: row-wise optimizers vs torch's, AUC, click log, config."""

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
