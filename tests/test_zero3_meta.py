"""ZeRO-3 built straight from a model on the meta device: each rank allocates only its shard (measured
with the allocation meter), its initial values equal one process's bit for bit (dense, ep2 × ZeRO-3,
tp2 × ZeRO-3), and it trains exactly like the engine built from a whole real model (also in manual mode,
a pipeline's). Low-precision gathers move 2 bytes
per parameter; ``zero.prefetch`` bounds how many units are gathered at once; ``reshard_after_forward =
false`` keeps units gathered between forward and backward, also when built from meta in bf16."""

import pytest
import torch

from tessera.comm import CommLedger
from tessera.models import Transformer, init, model_config
from tessera.models.layers import TransformerBlock, precompute_rope
from tessera.models.moe import MoEConfig
from tessera.moe import apply_expert_parallel, expert_zero
from tessera.moe.expert_parallel import global_expert_state
from tessera.parallelize import norm_axes, parallelize_model_side, sharded_axes
from tessera.precision import PrecisionConfig
from tessera.testing.alloc import AllocationMeter
from tessera.topology import ParallelConfig, Topology
from tessera.train.memory import storage_bytes
from tessera.train.optim import OptimConfig, optimizer_factory, param_groups
from tessera.train.step import forward_backward
from tessera.zero import ZeroConfig
from tessera.zero.build import shard_model

CPU = torch.device("cpu")
SEED, CHUNK = 11, 200  # a small chunk, so that the model is many chunks and the bound discriminates
SEQ, BATCH = 16, 2
TEMPORARY_CHUNKS = 1  # an origin fills a contiguous range from one drawn chunk at a time (tessera.models.init)
STRIDED_TEMPORARY_CHUNKS = 2  # a strided origin (a tp slice): the drawn chunk and the index maps of a piece of CHUNK / 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_cfg(moe: bool, n_layers: int = 2):
    extra = dict(num_experts=4, moe_every=1) if moe else {}
    return model_config("tiny", n_layers=n_layers, **extra)


def build_model(moe: bool, device: str, n_layers: int = 2) -> Transformer:
    with torch.device(device):
        return Transformer(model_cfg(moe, n_layers), MoEConfig(top_k=2) if moe else None, seed=SEED)


def build_engine(model, topo, dtype, ep, zero=None):
    """ZeRO-3 over ``model`` the way parallelize() builds it (the expert engine under ep)."""
    cfg, precision, zero = OptimConfig(), PrecisionConfig(dtype=dtype), zero or ZeroConfig()
    if ep > 1:
        return expert_zero(model, topo, lambda m: param_groups(m, cfg), optimizer_factory(cfg), 3, zero,
                           norm_axes(topo), sharded_axes(model, topo), precision=precision, device=CPU)
    return shard_model(model, param_groups(model, cfg), optimizer_factory(cfg), topo, 3, zero, precision, CPU,
                       block_class=TransformerBlock, norm_axes=norm_axes(topo), param_axes=sharded_axes(model, topo))


def global_name(name: str, expert_names: dict) -> str:
    """A local parameter name as the whole model names it (an ep rank's experts renumbered)."""
    if name not in expert_names:
        return name
    index, leaf = expert_names[name]
    return f"{name.split('.experts.')[0]}.experts.{index}.{leaf}"


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same names, and each tensor equal bit for bit."""
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def full_values(engine, expert_names: dict) -> dict[str, torch.Tensor]:
    """Whole-model name → the gathered parameter."""
    parts = getattr(engine, "parts", (engine,))
    return {global_name(n, expert_names): v for part in parts for n, v in part.full_state().items()}


def masters(engine, expert_names: dict) -> list[tuple[torch.Tensor, int, list]]:
    """Per flat: (fp32 master slice, rank in its shard group, [(whole-model name, offset)])."""
    return [(master.detach().clone(), rank, [(global_name(n, expert_names), o) for n, _, o in entries])
            for master, rank, entries in engine.flat_shards()]


def held_bytes(engine, model) -> int:
    """Bytes of the tensors this rank holds after the build: the engine's shards (compute-dtype params,
    fp32 masters, gradient slices, optimizer state) and the model's buffers and unsharded parameters."""
    tensors = [t for ts in engine.memory_tensors().values() for t in ts if t is not None]
    return storage_bytes(tensors + list(model.buffers()) + list(model.parameters()))


# ---- the build: bytes, initial values -------------------------------------------------------------

def build_worker(rank, world_size, dtype, ep):
    chunk, init.CHUNK = init.CHUNK, CHUNK  # the pool's workers live on: restore it afterwards
    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size, ep=ep, zero_stage=3))
    try:
        with AllocationMeter() as meter:
            model = build_model(ep > 1, "meta")
            if ep > 1:
                apply_expert_parallel(model, topo.group("ep"))
            experts = global_expert_state(model)  # before the engine takes the parameters out
            engine = build_engine(model, topo, dtype, ep)
        meta_left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        with AllocationMeter() as rope:  # the RoPE tables' float64 scratch: a constant, not a parameter's
            precompute_rope(model.cfg.head_dim, model.cfg.max_seq_len)
        return {"peak": meter.peak_bytes, "end": meter.end_bytes, "held": held_bytes(engine, model),
                "scratch": rope.peak_bytes,
                "meta_left": meta_left, "masters": masters(engine, experts),
                "values": full_values(engine, experts)}
    finally:
        init.CHUNK = chunk
        topo.destroy()


def reference_state(moe: bool, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(init, "CHUNK", CHUNK)
    return {k: v.detach() for k, v in build_model(moe, "cpu").named_parameters()}


def expected_slice(ref, entries, rank, n) -> torch.Tensor:
    """This rank's [n] slice of the flat buffer of ``entries`` [(name, offset)], built from ``ref``."""
    flat = torch.zeros(max((rank + 1) * n, max(o + ref[name].numel() for name, o in entries)))
    for name, o in entries:
        flat[o : o + ref[name].numel()] = ref[name].reshape(-1)
    return flat[rank * n : (rank + 1) * n]


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero3_from_meta_allocates_only_its_shard_and_starts_like_one_process(rank_pool, monkeypatch, dtype):
    ref = reference_state(False, monkeypatch)
    whole = sum(v.numel() * 4 for v in ref.values())  # the whole model in fp32
    chunk_bytes = 4 * CHUNK
    for rank, r in enumerate(rank_pool.run(build_worker, 4, dtype=dtype, ep=1)):
        print(f"\n{dtype}, rank {rank}: allocated at peak {r['peak']} B, held {r['held']} B, at the end {r['end']} B; "
              f"whole model {whole} B, chunk {chunk_bytes} B, RoPE scratch {r['scratch']} B")
        assert r["meta_left"] == []
        assert r["end"] == r["held"]  # every byte allocated and still alive is state the rank holds
        # at the peak, at most the temporaries of one step of an origin's fill more (two chunks when the
        # step straddles them, and their concatenation) and those of the RoPE tables
        budget = r["held"] + TEMPORARY_CHUNKS * chunk_bytes + r["scratch"]
        assert r["peak"] <= budget, (r["peak"], budget)
        assert whole > 2 * budget  # the bound is far below the whole model
        check_values(r, ref, DTYPES[dtype])


def check_values(r, ref, dtype, every=True):
    """The gathered parameters (all of ``ref``'s, or with ``every`` False a part: an ep rank's experts)
    and the fp32 master slices equal ``ref``'s values bit for bit."""
    assert set(r["values"]) == set(ref) if every else set(r["values"]) <= set(ref)
    for name, value in r["values"].items():
        assert value.dtype == dtype and torch.equal(value, ref[name].to(dtype)), name
    for master, rank, entries in r["masters"]:  # the fp32 masters: one process's values, bit for bit
        assert master.dtype == torch.float32
        assert torch.equal(master, expected_slice(ref, entries, rank, master.numel()))


@pytest.mark.multirank
def test_ep2_zero3_from_meta_starts_like_one_process(rank_pool, monkeypatch):
    ref = reference_state(True, monkeypatch)
    results = rank_pool.run(build_worker, 4, dtype="bf16", ep=2)
    for r in results:
        assert r["meta_left"] == []
        assert r["peak"] <= r["held"] + TEMPORARY_CHUNKS * 4 * CHUNK + r["scratch"]
        check_values(r, ref, torch.bfloat16, every=False)
    assert set().union(*(r["values"] for r in results)) == set(ref)  # each ep rank its own experts
    assert all(len(r["values"]) < len(ref) for r in results)


# ---- training: meta equals real; gathers in the compute dtype; bounded prefetch ------------------------

def batches(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return [(x[:, :-1], x[:, 1:])]


def instrument(engine) -> dict:
    """Count, through every flat's gather: the most non-root units gathered at once, the elements newly
    gathered; and record the dtypes of the gathered buffers and of their gradients."""
    seen = {"units": 0, "elements": 0, "dtypes": set(), "grad_dtypes": set()}
    others = engine.units[1:]  # the root's forward encloses the others': it is gathered throughout

    def counting(f, gather):
        def wrapper(async_op=False):
            seen["elements"] += 0 if f.gathered else f.size
            gather(async_op)
            seen["units"] = max(seen["units"], sum(any(g.gathered for g in u.flats) for u in others))
            seen["dtypes"].add(f.full.dtype)
        return wrapper

    for f in engine.flats:
        f.gather = counting(f, f.gather)
        f.full.register_hook(lambda grad: seen["grad_dtypes"].add(grad.dtype))
    return seen


def train_worker(rank, world_size, dtype, meta, prefetch=1, reshard=True, n_layers=2, steps=2):
    """``steps`` steps of ZeRO-3 built from a meta or a real model: losses, the last step's all-gather
    bytes (ledger) and gathered elements, the instrument's maxima and dtypes, the final parameters."""
    chunk, init.CHUNK = init.CHUNK, CHUNK
    ledger = CommLedger()
    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size, zero_stage=3), ledger)
    try:
        model = build_model(False, "meta" if meta else "cpu", n_layers)
        zero = ZeroConfig(prefetch=prefetch, reshard_after_forward=reshard)
        engine = build_engine(model, topo, dtype, 1, zero)
        seen = instrument(engine)
        losses = []
        for step in range(steps):
            mark, elements = ledger.stats(), seen["elements"]
            losses.append(forward_backward(engine, batches(step, rank), topo.group("dp"), CPU).loss)
            engine.clip_grad_norm(1.0)
            engine.step()
            engine.zero_grad()
        gathered = sum(s.bytes for (_, op), s in ledger.since(mark).items() if op == "all_gather")
        psi = sum(f.size for f in engine.flats)  # padded parameter elements
        return {"losses": losses, "gather_bytes": gathered, "gather_elements": seen["elements"] - elements,
                "psi": psi, "units": seen["units"], "n_units": len(engine.units) - 1,
                "dtypes": seen["dtypes"], "grad_dtypes": seen["grad_dtypes"], "params": full_values(engine, {})}
    finally:
        init.CHUNK = chunk
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero3_from_meta_trains_like_zero3_from_a_real_model(rank_pool, dtype):
    """Same values, same math: bit for bit. And the all-gathers move the compute dtype: 2 bytes per
    parameter in bf16 (4 in fp32), each unit gathered twice a step (forward and backward)."""
    meta = rank_pool.run(train_worker, 2, dtype=dtype, meta=True)
    real = rank_pool.run(train_worker, 2, dtype=dtype, meta=False)
    for m, r in zip(meta, real):
        assert m["losses"] == r["losses"]
        assert_same_tensors(m["params"], r["params"])
        size = DTYPES[dtype].itemsize
        assert m["dtypes"] == m["grad_dtypes"] == {DTYPES[dtype]}  # gathered units and their gradients
        assert m["gather_bytes"] == size * m["gather_elements"]
        # twice per step, less the root (final norm), which stays gathered from forward to backward
        assert 1.9 * m["psi"] < m["gather_elements"] <= 2 * m["psi"]


@pytest.mark.multirank
def test_prefetch_bounds_the_units_gathered_at_once(rank_pool):
    """zero.prefetch = k: at most k + 1 units (besides the root) gathered at any time through forward and
    backward, and exactly that many at the busiest moment; the result does not depend on k."""
    runs = {k: rank_pool.run(train_worker, 2, dtype="fp32", meta=True, prefetch=k, n_layers=4) for k in (0, 1, 2)}
    for k, results in runs.items():
        for r, first in zip(results, runs[0]):
            assert r["n_units"] == 6  # embedding, 4 blocks, output head
            assert r["units"] == k + 1, (k, r["units"])
            assert r["losses"] == first["losses"]
            assert all(torch.equal(v, first["params"][n]) for n, v in r["params"].items())


@pytest.mark.multirank
def test_units_stay_gathered_between_forward_and_backward_when_asked(rank_pool):
    """reshard_after_forward = false, built from meta in bf16: every unit gathered once per step (not
    twice), all of them held at once after the forward; training identical to resharding."""
    kept = rank_pool.run(train_worker, 2, dtype="bf16", meta=True, reshard=False)
    freed = rank_pool.run(train_worker, 2, dtype="bf16", meta=True, reshard=True)
    for k, f in zip(kept, freed):
        assert k["losses"] == f["losses"]
        assert all(torch.equal(v, f["params"][n]) for n, v in k["params"].items())
        assert k["units"] == k["n_units"] and f["units"] == 2
        assert k["gather_elements"] == k["psi"] and k["gather_bytes"] == 2 * k["psi"]


# ---- tensor parallelism underneath ---------------------------------------------------------------

def tp_worker(rank, world_size, meta):
    """tp2 × ZeRO-3 (dp 2): the tp layers cut their slices on the meta model (recording the regions), then
    ZeRO-3 fills its flat slices through them; the allocation of the build and the gathered parameters."""
    chunk, init.CHUNK = init.CHUNK, CHUNK
    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size // 2, tp=2, zero_stage=3))
    try:
        with AllocationMeter() as meter:
            model = build_model(False, "meta" if meta else "cpu")
            parallelize_model_side(model, topo)
            engine = build_engine(model, topo, "fp32", 1)
        with AllocationMeter() as rope:
            precompute_rope(model.cfg.head_dim, model.cfg.max_seq_len)
        return {"peak": meter.peak_bytes, "held": held_bytes(engine, model), "scratch": rope.peak_bytes,
                "values": full_values(engine, {})}
    finally:
        init.CHUNK = chunk
        topo.destroy()


@pytest.mark.multirank
def test_tp2_zero3_from_meta_starts_like_from_a_real_model(rank_pool):
    meta = rank_pool.run(tp_worker, 4, meta=True)
    real = rank_pool.run(tp_worker, 4, meta=False)  # tp slices copied from one process's whole model
    for m, r in zip(meta, real):
        assert_same_tensors(m["values"], r["values"])
        # a tp slice is a strided region of its parameter: its fill maps the indices of a piece at a time
        assert m["peak"] <= m["held"] + STRIDED_TEMPORARY_CHUNKS * 4 * CHUNK + m["scratch"], m
        assert 4 * m["peak"] < r["peak"]  # the real build allocates the whole model first


# ---- manual mode (a pipeline's) ------------------------------------------------------------------

def manual_worker(rank, world_size, meta):
    """Manual mode as a pipeline drives it (see tests/test_zero_manual.py): a holder of the model's parts
    that is never called itself, two micro-batches through them, ``reduce_gradients()`` once a step."""
    from torch import nn

    chunk, init.CHUNK = init.CHUNK, CHUNK
    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size, zero_stage=3))
    try:
        model = build_model(False, "meta" if meta else "cpu")
        init.materialize_buffers(model, CPU)  # the RoPE tables live outside the holder
        holder = nn.Module()
        for name in ("tok_embeddings", "layers", "norm", "output"):
            setattr(holder, name, getattr(model, name))
        cfg = OptimConfig()
        engine = shard_model(holder, param_groups(holder, cfg), optimizer_factory(cfg), topo, 3, ZeroConfig(),
                             PrecisionConfig(dtype="bf16"), CPU, block_class=TransformerBlock, manual=True)
        cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
        losses = []
        for step in range(2):
            for x, y in batches(step, rank) * 2:
                h = holder.tok_embeddings(x)
                for block in holder.layers.values():
                    h = block(h, cos, sin)
                loss = torch.nn.functional.cross_entropy(holder.output(holder.norm(h)).flatten(0, 1).float(),
                                                         y.flatten())
                loss.backward()
                losses.append(float(loss))
            engine.reduce_gradients()
            engine.clip_grad_norm(1.0)
            engine.step()
            engine.zero_grad()
        return {"losses": losses, "params": engine.full_state()}
    finally:
        init.CHUNK = chunk
        topo.destroy()


@pytest.mark.multirank
def test_manual_zero3_from_meta_trains_like_from_a_real_model(rank_pool):
    meta = rank_pool.run(manual_worker, 2, meta=True)
    real = rank_pool.run(manual_worker, 2, meta=False)
    for m, r in zip(meta, real):
        assert m["losses"] == r["losses"]
        assert_same_tensors(m["params"], r["params"])
