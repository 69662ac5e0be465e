"""No rank builds the whole model: a Transformer described on the meta device is cut by every strategy
(pipeline stages, tp slices, experts) and each rank allocates only what it holds, with the values one
process has (tessera.models.init), bit for bit."""

import pytest
import torch

from tessera.checkpoint import state_pieces
from tessera.data_parallel import DDPConfig
from tessera.models import Transformer, model_config
from tessera.models import init as init_mod
from tessera.models.layers import precompute_rope
from tessera.models.moe import MoEConfig
from tessera.parallelize import parallelize, unwrap
from tessera.pipeline import PipelineConfig
from tessera.tensor_parallel.vocab import VocabParallelEmbedding, VocabParallelHead
from tessera.topology import ParallelConfig, Topology
from tessera.train.optim import OptimConfig
from tessera.train.pipeline_step import PipelineStep

SEED = 11
SMALL_CHUNK = 1000  # elements: every parameter of these shapes spans several independently seeded chunks
# vocabulary 251: not a multiple of tp = 2, so the vocabulary-parallel layers hold a zero padding row
DENSE = dict(vocab_size=251, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=32)
MOE = dict(DENSE, num_experts=4, moe_every=1)


class small_chunks:
    """Set tessera.models.init.CHUNK for a block (the pool's workers live on: always restore it)."""

    def __enter__(self):
        self.before, init_mod.CHUNK = init_mod.CHUNK, SMALL_CHUNK

    def __exit__(self, *exc):
        init_mod.CHUNK = self.before


def meta_model(overrides: dict, tie: bool = False) -> Transformer:
    moe = MoEConfig(top_k=2) if overrides.get("num_experts") else None
    with torch.device("meta"):
        return Transformer(model_config("tiny", **overrides, tie_embeddings=tie), moe, seed=SEED)


def one_process(overrides: dict, tie: bool = False) -> dict[str, torch.Tensor]:
    moe = MoEConfig(top_k=2) if overrides.get("num_experts") else None
    return Transformer(model_config("tiny", **overrides, tie_embeddings=tie), moe, seed=SEED).state_dict()


def whole_numel(overrides: dict, tie: bool = False) -> int:
    """Parameters of the whole model (a tied weight once)."""
    return sum(p.numel() for p in meta_model(overrides, tie).parameters())


def mismatches(core, whole: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """(names of this rank's pieces whose values differ from one process's, vocabulary padding rows held).
    The pieces are its local parameters placed in the single-process model by the checkpoint's Placer;
    padding rows (past the vocabulary, so that tp divides it) must be zero."""
    bad, padding = [], 0
    for piece in state_pieces(core, None):
        name = piece.name.removeprefix("model/")
        region = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))
        if not torch.equal(piece.tensor, whole[name][region]):
            bad.append(name)
    for name, m in core.named_modules():
        if isinstance(m, (VocabParallelEmbedding, VocabParallelHead)):
            per = m.weight.shape[0]
            real = max(0, min(per, DENSE["vocab_size"] - m.group.rank * per))  # rows of real token ids
            padding += per - real
            if m.weight[real:].any():
                bad.append(f"{name}.weight padding")
    return bad, padding


def held(core) -> dict:
    """What this rank holds after the build: tensors left on the meta device (none may be), its parameter
    count, whether it has buffers (the RoPE tables at least)."""
    tensors = [*core.named_parameters(), *core.named_buffers()]
    return {"meta": [n for n, t in tensors if t.is_meta], "numel": sum(p.numel() for p in core.parameters()),
            "has_buffers": any(True for _ in core.buffers())}


def rope_equal(core, overrides: dict) -> bool:
    """Every (stage) Transformer in ``core`` holds the RoPE tables of its configuration."""
    cfg = model_config("tiny", **overrides)
    cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    models = [m for m in core.modules() if isinstance(m, Transformer)]
    return bool(models) and all(torch.equal(m.rope_cos, cos) and torch.equal(m.rope_sin, sin) for m in models)


# ---- pipelines (tp2 x pp2, tied pp2) -------------------------------------------------------------


def pipeline_worker(rank, world_size, pp, tp, tie):
    with small_chunks():
        topo = Topology.build(ParallelConfig(pp=pp, tp=tp, timeout_s=60))
        try:
            model = meta_model(DENSE, tie)
            step = PipelineStep(model, PipelineConfig(schedule="1f1b", microbatches=2), topo, "cpu", OptimConfig())
            whole = one_process(DENSE, tie)
            stages = list(step.pipe.stages.values())
            bad, padding = mismatches(step.module, whole)
            return {"bad": bad, "padding": padding, **held(torch.nn.ModuleList(stages)),
                    "rope": all(rope_equal(s, DENSE) for s in stages), "whole_numel": whole_numel(DENSE, tie)}
        finally:
            topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("pp,tp,tie", [(2, 2, False), (2, 1, True)], ids=["tp2xpp2", "pp2-tied"])
def test_pipeline_built_on_meta_equals_one_process(rank_pool, pp, tp, tie):
    results = rank_pool.run(pipeline_worker, pp * tp, pp=pp, tp=tp, tie=tie)
    for rank, r in enumerate(results):
        assert r["bad"] == [] and r["meta"] == [], (rank, r)
        assert r["rope"] and r["has_buffers"]
        assert r["padding"] == (1 if tp > 1 and rank % tp == tp - 1 else 0)  # vocabulary 251 over tp 2
        # each rank holds a part only: a stage (tied: the head's copy of the embedding on the last), a tp slice
        assert r["numel"] < r["whole_numel"] * (0.4 if tp > 1 else 0.75)


# ---- parallelize (dp2 x tp2, ep2) ----------------------------------------------------------------


def parallelize_worker(rank, world_size, parallel, overrides):
    with small_chunks():
        topo = Topology.build(ParallelConfig(**parallel, timeout_s=60))
        try:
            model = parallelize(meta_model(overrides), topo, DDPConfig(), device=torch.device("cpu"))
            core = unwrap(model)
            bad, padding = mismatches(core, one_process(overrides))
            return {"bad": bad, "padding": padding, **held(core), "rope": rope_equal(core, overrides),
                    "whole_numel": whole_numel(overrides)}
        finally:
            topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("parallel,overrides", [(dict(dp_replicate=2, tp=2), DENSE), (dict(dp_replicate=2, ep=2), MOE)],
                         ids=["dp2xtp2", "ep2-moe"])
def test_parallelize_on_meta_equals_one_process(rank_pool, parallel, overrides):
    world = parallel["dp_replicate"] * parallel.get("tp", 1)
    results = rank_pool.run(parallelize_worker, world, parallel=parallel, overrides=overrides)
    for rank, r in enumerate(results):
        assert r["bad"] == [] and r["meta"] == [], (rank, r)
        assert r["rope"] and r["has_buffers"]
        assert r["numel"] < r["whole_numel"]  # tp slices, or half of the experts
        # vocabulary 251 over tp 2: a padding row in the last tp rank's embedding and head
        assert r["padding"] == (2 if parallel.get("tp", 1) > 1 and rank % 2 == 1 else 0)


# ---- what a rank allocates while the model is built (tp2 x pp2) ----------------------------------

BIG = dict(DENSE, dim=64, ffn_hidden_dim=256)  # ~1.1 MB of fp32: many chunks, four times a rank's share


def one_chunk_temporaries() -> int:
    """Bytes of temporaries filling one chunk of a tensor-parallel slice costs (the output not counted): the
    worst of a column block (strided) and a row block with vocabulary padding, measured with the meter."""
    from tessera.testing.alloc import AllocationMeter

    spec = init_mod.InitSpec("w", (SMALL_CHUNK // 10, 20), "normal", 0.02, seed=1)  # 2 chunks
    worst = 0
    for region in (init_mod.Region(10, (SMALL_CHUNK // 10, 10), (20, 1)),  # columns 10..19
                   init_mod.Region(0, (2 * SMALL_CHUNK // 20, 20), (20, 1), rows=SMALL_CHUNK // 20)):
        out = torch.empty(region.sizes)
        with AllocationMeter() as meter:
            init_mod.Origin(spec, (region,)).fill_(out)
        worst = max(worst, meter.peak_bytes)
    return worst


def held_bytes(modules) -> int:
    """Bytes of the distinct storages of every parameter and buffer of ``modules``."""
    storages = {}
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def build_memory_worker(rank, world_size):
    from tessera.testing.alloc import AllocationMeter

    with small_chunks():
        topo = Topology.build(ParallelConfig(pp=2, tp=2, timeout_s=60))
        try:
            chunk = one_chunk_temporaries()
            with AllocationMeter() as meter:
                model = meta_model(BIG)
                step = PipelineStep(model, PipelineConfig(schedule="1f1b", microbatches=2), topo, "cpu",
                                    OptimConfig())
            share = held_bytes(step.pipe.stages.values())
            bad, _ = mismatches(step.module, one_process(BIG))
            return {"peak": meter.peak_bytes, "end": meter.end_bytes, "share": share, "chunk": chunk,
                    "whole": 4 * whole_numel(BIG), "bad": bad}
        finally:
            topo.destroy()


@pytest.mark.multirank
def test_tp2xpp2_rank_allocates_its_share_plus_one_chunk(rank_pool):
    results = rank_pool.run(build_memory_worker, 4)
    for rank, r in enumerate(results):
        assert r["bad"] == [], (rank, r)
        assert r["whole"] > 2 * (r["share"] + r["chunk"]), r  # the bound below tells a whole build apart
        assert r["peak"] <= r["share"] + r["chunk"], (rank, r)
        assert r["share"] <= r["end"] <= r["share"] + r["chunk"], (rank, r)  # what it holds afterwards


def test_materialize_refuses_a_meta_buffer_nothing_recreates():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.empty(3, device="meta"))

    with pytest.raises(ValueError, match="init_buffers"):
        init_mod.materialize(Holder(), torch.device("cpu"))
