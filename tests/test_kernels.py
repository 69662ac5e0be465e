"""``[kernels]`` adamw / rms_norm / gqa: each choice trains like the default, alone and under the strategies.

1. Ops: ``rms_normalize`` with F.rms_norm, and ``causal_sdpa`` with SDPA's enable_gqa (training's causal
   case and the KV-cache decode mask), equal the reference formulas; bf16 input stays accurate (fp32 inside).
2. Disk offload's streamed AdamW honours a fused / foreach template, bit for bit like torch's AdamW.
3. Trainer: the tiny GQA model (4 query heads, 2 kv heads) trains 2 steps like the default run (fp32: losses
   rel 1e-5, gradient norms rel 1e-4) with each choice in one process, and with the choices together under
   dp2, ZeRO-3, tp2 + SP, 2D tensor parallelism (4 ranks), pp2 and Ulysses cp2. Each run also counts the
   calls of the chosen kernel (F.rms_norm, SDPA with enable_gqa, torch's fused / foreach Adam), so a choice
   that never reached its module would fail even though its losses match. A run's checkpoint, loaded for
   generation, decodes with the run's rms_norm and gqa choices.
4. Refusals: the layouts where a choice has no operation to act on fail validation with one sentence, and
   kernels.gqa on a model without grouped-query attention.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from tessera.errors import ConfigError
from tessera.kernels.apply import apply_kernels
from tessera.kernels.config import KernelsConfig
from tessera.launch import run_rank
from tessera.models import model_config
from tessera.models.layers import causal_sdpa, repeat_kv, rms_normalize
from tessera.models.llama import Transformer
from tessera.train.config import load_config, validate_config
from tessera.train.optim import OptimConfig, optimizer_factory

from test_trainer import tiny_args
from test_trainer_strategies import assert_like_single_process, metrics, single_process_runs


# ---- 1. the ops -----------------------------------------------------------------------------------------

def test_torch_rms_norm_equals_the_reference_formula_in_fp32_and_bf16():
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(0)) * 3
    ref = rms_normalize(x, 1e-5)
    torch.testing.assert_close(rms_normalize(x, 1e-5, "torch"), ref, rtol=1e-6, atol=1e-6)
    low = rms_normalize(x.bfloat16(), 1e-5, "torch")
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, rms_normalize(x.bfloat16(), 1e-5))  # both normalise the same fp32 copy


@pytest.mark.parametrize("offset", [0, 3])
def test_sdpa_gqa_equals_repeated_kv(offset):
    """q [2, 4, 4 heads, 8] over k, v [2, offset + 4, 2 kv heads, 8]; offset 3 is a KV-cache decode step."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 4, 8, generator=g), torch.randn(2, 4 + offset, 2, 8, generator=g), \
        torch.randn(2, 4 + offset, 2, 8, generator=g)
    mask = torch.ones(4, 4 + offset, dtype=torch.bool).tril(offset) if offset else None
    got = causal_sdpa(q, k, v, "sdpa", mask)
    want = causal_sdpa(q, k, v, "repeat", mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # and the repeat path is attention over head h // 2 (not a copy of the same code)
    scores = torch.einsum("bshe,bthe->bhst", q, repeat_kv(k, 2)) / 8 ** 0.5
    allowed = torch.ones(4, 4 + offset, dtype=torch.bool).tril(offset)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    torch.testing.assert_close(want, torch.einsum("bhst,bthe->bshe", probs, repeat_kv(v, 2)), rtol=1e-5, atol=1e-5)


def test_apply_kernels_sets_every_norm_and_core():
    model = Transformer(model_config("tiny"), seed=0)
    apply_kernels(model, KernelsConfig(rms_norm="torch", gqa="sdpa"))
    norms = [m for m in model.modules() if hasattr(m, "rms_norm_kernel")]
    cores = [m for m in model.modules() if hasattr(m, "gqa_kernel")]
    assert len(norms) == 2 * 2 + 1 and len(cores) == 2  # two per block and the final norm; a core per block
    assert {m.rms_norm_kernel for m in norms} == {"torch"} and {m.gqa_kernel for m in cores} == {"sdpa"}


# ---- 2. disk offload's streamed AdamW ---------------------------------------------------------------------

@pytest.mark.parametrize("adamw", ["fused", "foreach"])
def test_streamed_adamw_follows_a_fused_or_foreach_template(tmp_path, adamw):
    from tessera.zero.offload import OffloadFolder, StreamedAdamW, disk_master

    g = torch.Generator().manual_seed(2)
    init, grads = torch.randn(3000, generator=g), [torch.randn(3000, generator=g) for _ in range(3)]
    folder = OffloadFolder(tmp_path, 0, chunk=1024)  # 3 chunks of a page's worth (4 KiB) each
    mirror = torch.zeros(3000)
    master = disk_master(init, mirror, folder)
    plain = torch.nn.Parameter(init.clone())
    make = optimizer_factory(OptimConfig(weight_decay=0.1), adamw)
    streamed = StreamedAdamW(make([{"params": [master], "weight_decay": 0.1}]))
    reference = make([{"params": [plain], "weight_decay": 0.1}])
    for grad in grads:
        master.grad, plain.grad = grad.clone(), grad.clone()
        streamed.step()
        reference.step()
    assert torch.equal(mirror, plain.detach())
    assert torch.equal(streamed.state[master]["exp_avg_sq"], reference.state[plain]["exp_avg_sq"])


# ---- 3. the trainer ----------------------------------------------------------------------------------------

ALL = ["--kernels.adamw=fused", "--kernels.rms_norm=torch", "--kernels.gqa=sdpa"]
BASE = ["--checkpoint.save_final=false", "--train.steps=2", "--train.log_every=1", "--train.eval_every=2",
        "--data.eval_batches=1", "--data.global_batch_size=8", "--data.micro_batch_size=2",
        "--optim.warmup_steps=1"]
RUNS = {  # name → (world size, flags); the 2D grid's norm is its own (check_kernels), so rms_norm stays
    "adamw-fused": (1, ["--kernels.adamw=fused"]),
    "adamw-foreach": (1, ["--kernels.adamw=foreach"]),
    "rms_norm-torch": (1, ["--kernels.rms_norm=torch"]),
    "gqa-sdpa": (1, ["--kernels.gqa=sdpa"]),
    "dp2": (2, [*ALL]),
    "zero3": (2, [*ALL, "--parallel.dp_shard=2", "--parallel.zero_stage=3"]),
    "tp2-sp": (2, [*ALL, "--parallel.tp=2", "--tensor_parallel.sequence_parallel=true"]),
    "2d": (4, ["--kernels.adamw=fused", "--kernels.gqa=sdpa", "--parallel.tp=4", "--tensor_parallel.mode=2d"]),
    "pp2": (2, [*ALL, "--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"]),
    "cp2-ulysses": (2, [*ALL, "--parallel.cp=2", "--context_parallel.method=ulysses"]),
}


@contextlib.contextmanager
def counting_kernels():
    """Count the calls of each chosen kernel while the block runs (Counter: rms_norm, sdpa_gqa, fused, foreach)."""
    import torch.optim.adam as adam_module

    calls = Counter()
    saved = (F.rms_norm, F.scaled_dot_product_attention, adam_module._fused_adam, adam_module._multi_tensor_adam)

    def counted(name, fn, when=lambda kwargs: True):
        def wrapper(*args, **kwargs):
            calls[name] += bool(when(kwargs))
            return fn(*args, **kwargs)
        return wrapper

    F.rms_norm = counted("rms_norm", saved[0])
    F.scaled_dot_product_attention = counted("sdpa_gqa", saved[1], lambda kw: kw.get("enable_gqa", False))
    adam_module._fused_adam = counted("fused", saved[2])
    adam_module._multi_tensor_adam = counted("foreach", saved[3])
    try:
        yield calls
    finally:
        F.rms_norm, F.scaled_dot_product_attention, adam_module._fused_adam, adam_module._multi_tensor_adam = saved


def kernels_worker(rank, world_size, args):
    with counting_kernels() as calls:
        summary = run_rank(load_config(None, args))
    return {**summary, "kernel_calls": dict(calls)}


def _args(out, cache, flags):
    return tiny_args(out, cache, extra=[*BASE, *flags])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache):
    runs = single_process_runs(tmp_path_factory.mktemp("kernels_ref"),
                               lambda out, key: _args(out, corpus_cache, [f"--run.name={key}"]))
    return runs("default")


def _expect_calls(calls: dict, flags: list[str]) -> None:
    expected = {"--kernels.adamw=fused": "fused", "--kernels.adamw=foreach": "foreach",
                "--kernels.rms_norm=torch": "rms_norm", "--kernels.gqa=sdpa": "sdpa_gqa"}
    for flag, name in expected.items():
        if flag in flags:
            assert calls.get(name, 0) > 0, f"{flag}: its kernel never ran"
        else:
            assert calls.get(name, 0) == 0, f"{name} ran without {flag}"


@pytest.mark.parametrize("name", [n for n, (w, _) in RUNS.items() if w == 1])
def test_kernel_choice_trains_like_the_default_in_one_process(tmp_path, corpus_cache, reference, name):
    _, flags = RUNS[name]
    single, ref = reference
    got = kernels_worker(0, 1, _args(tmp_path, corpus_cache, [*flags, f"--run.name={name}"]))
    _expect_calls(got["kernel_calls"], flags)
    assert_like_single_process([got], single, ref, metrics(tmp_path / name), 1)


@pytest.mark.multirank
@pytest.mark.parametrize("name", [n for n, (w, _) in RUNS.items() if w > 1])
def test_kernel_choices_match_single_process(rank_pool, tmp_path, corpus_cache, reference, name):
    world, flags = RUNS[name]
    single, ref = reference
    args = _args(tmp_path, corpus_cache, [*flags, f"--run.name={name}"])
    validate_config(load_config(None, args), world)
    results = rank_pool.run(kernels_worker, world, args=args, timeout=600.0)
    for r in results:
        _expect_calls(r["kernel_calls"], flags)
    assert_like_single_process(results, single, ref, metrics(tmp_path / name), world)


def test_a_checkpoint_decodes_with_its_runs_kernels(tmp_path, corpus_cache):
    """``tessera generate``'s model of a run's checkpoint computes with the run's rms_norm and gqa."""
    from tessera.generate.decode import generate
    from tessera.generate.run_model import load_run_model

    flags = ["--kernels.rms_norm=torch", "--kernels.gqa=sdpa"]
    run_rank(load_config(None, _args(tmp_path, corpus_cache, [*flags, "--train.steps=1", "--train.eval_every=1",
                                                              "--checkpoint.save_final=true", "--run.name=g"])))
    loaded = load_run_model(tmp_path / "g" / "checkpoint")
    with counting_kernels() as calls:
        generate(loaded.model, [1, 2, 3], max_new_tokens=2)
    assert calls["rms_norm"] > 0 and calls["sdpa_gqa"] > 0, dict(calls)  # prefill and the KV-cache decode step


# ---- 4. refusals --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world, flags, words", [
    (4, ["--kernels.rms_norm=torch", "--parallel.tp=4", "--tensor_parallel.mode=2d"], "F.rms_norm cannot"),
    (2, ["--kernels.gqa=sdpa", "--parallel.cp=2"], "block by block round the ring"),
    (2, ["--kernels.gqa=sdpa", "--parallel.cp=2", "--context_parallel.method=ring_self_attention"],
     "block by block round the ring"),
    (1, ["--kernels.gqa=sdpa", "--model.n_kv_heads=4"], "model.n_kv_heads=4 equals model.n_heads=4"),
])
def test_a_choice_without_an_operation_to_act_on_is_refused(tmp_path, world, flags, words):
    cfg = load_config(None, ["--model.preset=tiny", "--data.seq_len=32", "--data.global_batch_size=8",
                             f"--run.out_dir={tmp_path}", *flags])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_choice_is_refused():
    with pytest.raises(ConfigError, match="kernels.adamw='apex' is unknown"):
        KernelsConfig(adamw="apex").validate()
