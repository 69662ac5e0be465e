"""LoRA under tensor parallelism (1D ± SP, 2D, 2.5D, 3D): N ranks equal one process.

Each layout splits a dense adapter A [r, I], B [O, r] to match its weight (tessera.tensor_parallel.adapters):
the same tiny adapted model (every target: wq wk wv wo w1 w2 w3; B random so A has a gradient from the
first step on) is trained 4 AdamW steps on one process and on the ranks; the losses agree (rel 1e-5), the
first-step adapter gradients agree, every rank's final adapter pieces, put back in place with their
``region``, cover the dense adapters and equal them, and every base weight is bit-identical to its start
and has no gradient. A ledger check shows the adapters move no extra forward bytes under 1D tp.
"""

from __future__ import annotations

import pytest
import torch

from tessera.checkpoint.placement import Placer
from tessera.comm import CommLedger
from tessera.errors import ConfigError
from tessera.lora import TARGETS, LoRAConfig, add_lora, is_adapter_name
from tessera.models import Transformer, cross_entropy_sum, model_config
from tessera.tensor_parallel import TensorParallelConfig, TensorParallelLoss, apply_tensor_parallel
from tessera.tensor_parallel import vocab_parallel_cross_entropy_sum
from tessera.tensor_parallel.adapters import AdapterFactor
from tessera.tensor_parallel.nd.model import apply_nd_tensor_parallel, batch_share
from tessera.topology import ParallelConfig, Topology
from tessera.train.config import load_config, validate_config
from tessera.train.trainer import Trainer
from test_trainer import tiny_args
from test_trainer_strategies import assert_like_single_process, metrics
from tolerance import ADAM_EPS, assert_close_but_few

B, S, STEPS, VOCAB, RANK = 4, 16, 4, 64, 4
CFG = model_config("tiny", vocab_size=VOCAB, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, n_layers=2)
LORA = LoRAConfig(rank=RANK, alpha=8.0, targets=list(TARGETS))


def adapted_model(lora: bool = True, cfg=CFG) -> Transformer:
    """The tiny model with adapters on every target; B drawn by name (zero by default) so that A's
    gradient, and so a misplaced A block, shows from the first step."""
    model = Transformer(cfg, seed=0)
    if lora:
        add_lora(model, LORA, seed=0)
        with torch.no_grad():
            for i, (name, p) in enumerate(sorted(model.named_parameters())):
                if name.endswith("lora_B.weight"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
    return model


def batch(step: int, rows: int = B):
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randint(0, VOCAB, (rows, S + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train(model, loss_fn, steps=STEPS, share=lambda x, y: (x, y)):
    """AdamW on the trainable (adapter) parameters; losses (global-mean token loss), first-step adapter
    gradients and the final adapter pieces, after checking every frozen parameter kept its values."""
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0, eps=ADAM_EPS)
    losses, grads = [], None
    for step in range(steps):
        x, y = share(*batch(step))
        s, n = loss_fn(model(x), y)
        (s / (B * S)).backward()
        losses.append(float(s.detach()) / (B * S))
        if grads is None:
            grads = pieces(model, lambda p: p.grad.clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"frozen {n} got a gradient"
            assert torch.equal(p.detach(), base[n]), f"frozen {n} changed"
    return {"losses": losses, "grads": grads, "params": pieces(model, lambda p: p.detach().clone())}


def pieces(model, value) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """Adapter parameter name → (single-process shape, offsets, local value)."""
    out = {}
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            module = model.get_submodule(name.rsplit(".", 1)[0])
            shape, offsets = module.region(p.shape) if isinstance(module, AdapterFactor) else (p.shape, (0,) * p.dim())
            out[name] = (tuple(shape), tuple(offsets), value(p))
    return out


def assemble_and_check(ref: dict, outs: list[dict], what: str, close) -> None:
    """Put every rank's pieces of each adapter tensor in place: overlaps agree, every element is held,
    and the whole equals the single-process tensor (``close(actual, expected, msg)``)."""
    for name, (_, _, dense) in ref.items():
        whole = torch.full_like(dense, float("nan"))
        for o in outs:
            if name not in o[what]:  # another pipeline stage's, or another ep rank's expert
                continue
            shape, offsets, local = o[what][name]
            assert shape == tuple(dense.shape), name
            box = tuple(slice(a, a + n) for a, n in zip(offsets, local.shape))
            held = whole[box]
            seen = ~held.isnan()
            torch.testing.assert_close(local[seen], held[seen], rtol=0, atol=0, msg=f"{name}: replicas differ")
            whole[box] = local
        assert not whole.isnan().any(), f"{name}: some entries are held by no rank"
        close(whole, dense, f"{what} of {name}")


def check_like_single_process(ref, outs, grad_rtol=1e-4, repeats: int | None = None):
    """``repeats``: each rank's loss is the sum over its own tokens, counted on this many ranks (the grids'
    vocabulary ranks); None: every rank holds the whole loss."""
    for o in outs if repeats is None else [{"losses": [sum(v) / repeats for v in zip(*(o["losses"] for o in outs))]}]:
        torch.testing.assert_close(o["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    assert len(set(round(v, 6) for v in ref["losses"])) == STEPS  # the adapters train: the loss moves
    assemble_and_check(ref["grads"], outs, "grads", lambda a, e, m: torch.testing.assert_close(
        a, e, rtol=grad_rtol, atol=1e-6, msg=m))
    assemble_and_check(ref["params"], outs, "params", lambda a, e, m: assert_close_but_few(
        a, e, rtol=1e-4, atol=1e-5, loose_atol=2e-2 * STEPS, msg=m))


def single_process():
    return train(adapted_model(), lambda logits, y: cross_entropy_sum(logits, y))


# ---- 1D (Megatron), with and without sequence parallelism ------------------------------------------------

def tp_worker(rank, world_size, sp):
    topo = Topology.build(ParallelConfig(tp=world_size))
    try:
        tp = topo.group("tp")
        model = apply_tensor_parallel(adapted_model(), tp, TensorParallelConfig(sequence_parallel=sp))
        return train(model, TensorParallelLoss(tp))
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_lora_tp_matches_single_process(rank_pool, sp):
    check_like_single_process(single_process(), rank_pool.run(tp_worker, 2, sp=sp))


def ledger_worker(rank, world_size, sp):
    """tp-axis bytes of one forward with and without adapters (same model otherwise)."""
    ledger = CommLedger()
    topo = Topology.build(ParallelConfig(tp=world_size), ledger)
    try:
        tp, out = topo.group("tp"), {}
        for lora in (False, True):
            dense = adapted_model(lora)
            for name, p in dense.named_parameters():  # as under LoRA: no gradient below block 0's attention,
                if name.startswith("tok_embeddings") or name.endswith("norm.weight"):  # none for SP's norms
                    p.requires_grad_(False)
            model = apply_tensor_parallel(dense, tp, TensorParallelConfig(sequence_parallel=sp))
            x, y = batch(0)
            before = ledger.stats()
            logits = model(x)
            fwd = ledger.since(before)
            s, n = TensorParallelLoss(tp)(logits, y)
            before = ledger.stats()
            s.backward()
            bwd = ledger.since(before)
            out[lora] = {phase: {op: (v.count, v.bytes) for (axis, op), v in st.items() if axis == "tp"}
                         for phase, st in (("fwd", fwd), ("bwd", bwd))}
        return out
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_lora_tp_forward_moves_no_extra_bytes(rank_pool, sp):
    """The adapters ride the layers' own collectives: the forward's tp traffic is unchanged. Backward adds
    one all-reduce per adapted layer of the replicated factor's gradient (A [r, I] column-, B [O, r]
    row-parallel) and nothing else. The plain model's embedding and norms are frozen as under LoRA, so
    neither computes block 0's input gradient nor (SP) all-reduces norm-weight gradients."""
    out = rank_pool.run(ledger_worker, 2, sp=sp)[0]
    assert out[True]["fwd"] == out[False]["fwd"] and out[False]["fwd"]
    plain, lora = out[False]["bwd"], out[True]["bwd"]
    extra = {op: (lora[op][0] - plain.get(op, (0, 0))[0], lora[op][1] - plain.get(op, (0, 0))[1]) for op in lora
             if lora[op] != plain.get(op)}
    # per block: A of wq wk wv w1 w3 ([r, D] each), B of wo and w2 ([D, r] each); fp32
    expected_bytes = CFG.n_layers * 4 * RANK * 7 * CFG.dim
    assert extra == {"all_reduce": (CFG.n_layers * 7, expected_bytes)}


# ---- 2D / 2.5D / 3D (Colossal-AI grids; each rank holds a batch block × feature block) -----------------

def nd_worker(rank, world_size, mode, depth):
    topo = Topology.build(ParallelConfig(tp=world_size))
    try:
        cfg = TensorParallelConfig(mode=mode, depth=depth)
        model = adapted_model()
        layout = apply_nd_tensor_parallel(model, topo.group("tp"), cfg, topo.partitions["tp"])
        share = lambda x, y: batch_share([(x, y)], layout, -100)[0]  # noqa: E731 (this rank's block)
        return train(model, lambda logits, y: vocab_parallel_cross_entropy_sum(logits, y, layout.vocab_group),
                     share=share)
    finally:
        topo.destroy()


ND = [("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)]


@pytest.mark.multirank
@pytest.mark.parametrize("mode,world,depth", ND, ids=[m for m, _, _ in ND])
def test_lora_grid_tp_matches_single_process(rank_pool, mode, world, depth):
    q = 2  # every grid here has side 2: a vocabulary block's loss is summed on q ranks
    check_like_single_process(single_process(), rank_pool.run(nd_worker, world, mode=mode, depth=depth, timeout=600.0),
                              repeats=q)


# ---- through the trainer (--lora.rank=4): hybrids with data, pipeline, context and expert parallelism --

TRAINER_BASE = ["--model.n_layers=2", "--checkpoint.save_final=false", "--train.steps=4", "--train.log_every=1",
                "--train.eval_every=4", "--data.eval_batches=1", f"--lora.rank={RANK}", "--lora.alpha=8",
                '--lora.targets=["wq","wk","wv","wo","w1","w2","w3"]']
MOE = ["--model.num_experts=4", "--moe.top_k=2"]
LAYOUTS = {  # name → (world size, model, flags)
    "dp2xtp2": (4, "dense", ["--parallel.dp_replicate=2", "--parallel.tp=2"]),
    "pp2xtp2": (4, "dense", ["--parallel.pp=2", "--parallel.tp=2", "--pipeline.schedule=1f1b",
                             "--pipeline.microbatches=4"]),
    "cp2": (2, "dense", ["--parallel.cp=2"]),
    "ep2": (2, "moe", ["--parallel.dp_replicate=2", "--parallel.ep=2"]),
    "2d": (4, "dense-mb4", ["--parallel.tp=4", "--tensor_parallel.mode=2d"]),
}


def _trainer_args(out, cache, model, extra):
    """``model``: "dense" or "moe", "-mb4" for micro-batches of 4 (the 2D grid: each of its micro-batches
    is hundreds of latency-bound collectives; 2 per step still accumulate) instead of 2."""
    micro = 4 if model.endswith("-mb4") else 2
    args = tiny_args(out, cache, extra=[*TRAINER_BASE, *(MOE if model == "moe" else []), *extra])
    return [*args, "--data.global_batch_size=8", f"--data.micro_batch_size={micro}"]


def lora_trainer_worker(rank, world_size, args):
    """Train through the Trainer; the summary and this rank's adapter pieces (by single-process name, via
    the checkpoints' placements), after checking the frozen weights kept their values and got no gradient."""
    trainer = Trainer(load_config(None, args), torch.device("cpu"))
    try:
        core = trainer.core
        base = {n: p.detach().clone() for n, p in core.named_parameters() if not p.requires_grad}
        assert base and all(is_adapter_name(n) for n, p in core.named_parameters() if p.requires_grad)
        summary = trainer.fit()
        placer, out = Placer(core), {}
        for n, p in core.named_parameters():
            if not p.requires_grad:
                assert p.grad is None and torch.equal(p.detach(), base[n]), f"frozen {n} changed"
            elif is_adapter_name(n):
                place = placer.place(n, p.shape)
                out[place.name] = (place.global_shape, place.offsets, p.detach().clone())
        return {"summary": summary, "params": out}
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def trainer_references(tmp_path_factory, corpus_cache):
    """One single-process LoRA run per model, made on first use."""
    out, done = tmp_path_factory.mktemp("reference"), {}

    def get(model):
        if model not in done:
            args = _trainer_args(out, corpus_cache, model, [f"--run.name={model}"])
            done[model] = (lora_trainer_worker(0, 1, args), metrics(out / model))
        return done[model]

    return get


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_hybrid_matches_single_process(rank_pool, tmp_path, corpus_cache, trainer_references, name):
    world, model, flags = LAYOUTS[name]
    single, ref = trainer_references(model)
    args = _trainer_args(tmp_path, corpus_cache, model, [*flags, f"--run.name={name}"])
    validate_config(load_config(None, args), world)
    results = rank_pool.run(lora_trainer_worker, world, args=args, timeout=600.0)
    assert_like_single_process([r["summary"] for r in results], single["summary"], ref, metrics(tmp_path / name),
                               world)
    assert len({round(r["loss"], 6) for r in ref if r["kind"] == "train"}) == 4  # the adapters train
    assemble_and_check(single["params"], results, "params", lambda a, e, m: assert_close_but_few(
        a, e, rtol=1e-4, atol=1e-5, loose_atol=1e-3, msg=m))
    if model == "moe":  # each expert's adapters went where the expert went; the router took none
        assert any(".experts.3.w2.lora_B" in n for n in single["params"])
        assert not any("router" in n for n in single["params"])


def _validate(world, args):
    cfg = load_config(None, ["--model.preset=tiny", "--data.seq_len=32", "--data.global_batch_size=8",
                             "--data.micro_batch_size=1", *args])
    return validate_config(cfg, world)


@pytest.mark.parametrize("args,words", [
    (["--parallel.tp=4", "--tensor_parallel.mode=2d", "--lora.dropout=0.1"], "set lora.dropout=0"),
    (["--parallel.tp=8", "--tensor_parallel.mode=3d", "--lora.rank=2"], "needs lora.rank (2) to be divisible by 4"),
    (["--parallel.tp=8", "--tensor_parallel.mode=2.5d", "--tensor_parallel.depth=2", "--lora.rank=6"],
     "needs lora.rank (6) to be divisible by 4"),
    (["--parallel.tp=8", "--tensor_parallel.mode=3d", "--model.ffn_hidden_dim=52", '--lora.targets=["w1"]'],
     "needs the model's ffn_hidden_dim (52) to be divisible by 8"),
], ids=["2d-dropout", "3d-rank", "2.5d-rank", "3d-adapted-output"])
def test_grid_refuses_an_adapter_it_cannot_split(args, words):
    """Before any rank starts, in one sentence: the grids have no dropout, and an adapter's blocks must
    split evenly (the same shapes without the adapter, or with lora.rank=0, are fine)."""
    world = 8 if "--parallel.tp=8" in args else 4
    with pytest.raises(ConfigError) as err:
        _validate(world, [f"--lora.rank={RANK}", *args])
    assert words in str(err.value) and "\n" not in str(err.value)
    _validate(world, [a for a in args if not a.startswith("--lora.")])
