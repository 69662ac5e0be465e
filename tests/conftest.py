"""Shared fixtures: the persistent gloo rank pool, and skipping GPU tests where there is no GPU."""

from __future__ import annotations

import pytest

from tessera.testing import PoolManager


@pytest.fixture(scope="session")
def rank_pool():
    """Run ``fn(rank, world_size, **params)`` on persistent gloo ranks: ``rank_pool.run(fn, world_size, ...)``.

    ``fn`` must be a module-level function of a test module; results come back as a list indexed by rank.
    """
    manager = PoolManager()
    yield manager
    manager.close_all()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """A token cache folder private to this test session (never the user's ~/.cache), built once."""
    from tessera.train.data import DataConfig, load_corpus

    path = str(tmp_path_factory.mktemp("corpus_cache"))
    load_corpus(DataConfig(cache_dir=path))
    return path


@pytest.fixture
def deepspeed_cpu(monkeypatch):
    """DeepSpeed imported on its CPU accelerator, the variable set for this test only.

    DeepSpeed reads ``DS_ACCELERATOR`` once, when ``deepspeed.accelerator.get_accelerator()`` first runs
    (``import deepspeed`` runs it), and keeps the accelerator in a module global; only that function reads
    the variable. So the first test that asks for this fixture fixes the choice for the session, later ones
    find it made, and monkeypatch removes the variable after each test: it never leaks into tests (or the
    ranks they spawn) that do not ask for DeepSpeed. Skips where DeepSpeed is not installed."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    get_accelerator()  # made now, while the variable is set
    return deepspeed
