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
