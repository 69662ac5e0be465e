"""2D, 2.5D and 3D tensor parallelism built from a model on the meta device: each rank allocates only its blocks.

On every rank the same Transformer is built twice with one seed: for real (every rank holds the whole
model, then the grid layers copy their blocks out of it) and on the meta device (nothing allocated; the
grid layers only record where their blocks come from, then ``materialize`` fills them). Every local
parameter must be equal bit for bit between the two, must be the block of the dense weight that its
module's ``region`` names (so the values are those of one process), and the meta path must allocate no
more than the local parameters plus a bounded init temporary (measured with ``AllocationMeter``), while
the whole model is several times larger.
"""

from __future__ import annotations

import pytest
import torch

from tessera.comm import CommLedger
from tessera.models import Transformer, model_config
from tessera.models.init import CHUNK, materialize
from tessera.parallelize import apply_tp
from tessera.tensor_parallel import TensorParallelConfig
from tessera.tensor_parallel.linear import is_sharded
from tessera.testing.alloc import AllocationMeter
from tessera.topology import ParallelConfig, Topology

SEED = 11
CFG = model_config("small", n_layers=2)  # 1.6M parameters (6.3 MB fp32); w1 176k elements, under one chunk
CHUNK_BYTES = CHUNK * 4  # one fp32 init chunk


def init_temporary(largest_local: int) -> int:
    """What filling a parameter may cost besides the parameter: one drawn chunk of the whole parameter, and
    while a block cut out of it is filled, its local-to-whole index maps (``Origin.fill_``: a few int64
    tensors and masks of the piece, ≈38 bytes a local element measured; at most CHUNK elements a piece)."""
    return CHUNK_BYTES + 40 * min(CHUNK, largest_local)


def _dense_block(dense: torch.Tensor, module, local: torch.Tensor) -> torch.Tensor:
    """The block of the single-process ``dense`` weight that ``module.region`` says ``local`` holds."""
    whole, offsets = module.region(tuple(local.shape))
    assert tuple(dense.shape) == tuple(whole)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
    return dense[index]


def meta_nd_worker(rank, world_size, mode, depth):
    topo = Topology.build(ParallelConfig(tp=world_size), CommLedger())
    tp, partition, tp_cfg = topo.group("tp"), topo.partitions["tp"], TensorParallelConfig(mode=mode, depth=depth)

    real = Transformer(CFG, seed=SEED)
    dense = {n: p.detach().clone() for n, p in real.named_parameters()}
    apply_tp(real, tp, tp_cfg, partition)

    with AllocationMeter() as meter:
        with torch.device("meta"):
            meta = Transformer(CFG, seed=SEED)
        apply_tp(meta, tp, tp_cfg, partition)
        materialize(meta, torch.device("cpu"))

    real_params, modules = dict(real.named_parameters()), dict(meta.named_modules())
    same_names = sorted(real_params) == sorted(n for n, _ in meta.named_parameters())
    differ, not_dense = [], []
    for name, p in meta.named_parameters():
        assert not p.is_meta and p.device.type == "cpu"
        if not torch.equal(p, real_params[name]) or is_sharded(p) != is_sharded(real_params[name]):
            differ.append(name)
        owner = modules[name.rsplit(".", 1)[0]]
        if not torch.equal(p, _dense_block(dense[name], owner, p)):
            not_dense.append(name)
    return {
        "differ": differ, "not_dense": not_dense, "same_names": same_names,
        "local_bytes": sum(p.numel() * p.element_size() for p in meta.parameters()),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in meta.buffers()),  # the RoPE tables
        "largest_local": max(p.numel() for p in meta.parameters()),
        "dense_bytes": sum(t.numel() * t.element_size() for t in dense.values()),
        "peak": meter.peak_bytes, "end": meter.end_bytes,
    }


@pytest.mark.parametrize("mode,depth,world", [("2d", 1, 4), ("2.5d", 2, 8), ("3d", 1, 8)])
def test_meta_nd_shards_equal_real_ones_and_cost_only_themselves(rank_pool, mode, depth, world):
    out = rank_pool.run(meta_nd_worker, world, mode=mode, depth=depth, timeout=600.0)
    for rank, r in enumerate(out):
        assert r["same_names"], rank
        assert r["differ"] == [], (rank, r["differ"])  # meta and real paths give identical (and as marked) shards
        assert r["not_dense"] == [], (rank, r["not_dense"])  # and they are one process's values
        held = r["local_bytes"] + r["buffer_bytes"]
        assert r["end"] == held  # what stays allocated is the rank's own blocks (and the RoPE tables)
        bound = held + init_temporary(r["largest_local"])
        assert r["peak"] <= bound, (rank, r["peak"] - held)
        assert r["dense_bytes"] > bound  # so the bound excludes building the whole model
    # each element of every weight is held by one tp rank: the local blocks add up to the whole model
    assert sum(r["local_bytes"] for r in out) == out[0]["dense_bytes"]
