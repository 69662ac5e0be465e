"""Test helpers: a persistent pool of gloo ranks for multi-rank tests (see ``rank_pool``)."""

from tessera.testing.rank_pool import PoolManager, RankFailure, RankPool, RankTimeout

__all__ = ["PoolManager", "RankFailure", "RankPool", "RankTimeout"]
