"""LoRA on N ranks equals LoRA in one process: data parallelism, the pipeline, ZeRO-1/2/3 and expert
parallelism (with DDP or ZeRO; tensor parallelism is tests/test_lora_tp.py's) train the adapters alone,
with every step's loss within 1e-5 of one process's, the final adapters equal and every base weight
bit-identical to its initial value. ZeRO-3 shards the frozen base weights but holds no gradient, master or
optimizer state for them (bytes from the engine's memory accounting); in bf16 they are held in bf16 alone.
"""

import pytest
import torch

from tessera.lora import is_adapter_name

from test_lora import STEPS, adapter_count, initial_values, lora_args, lora_run, lora_worker, train_losses
from test_trainer_strategies import LOW_PRECISION_BOUND
from tolerance import ADAM_EPS, assert_close_but_few

EPS = [f"--optim.eps={ADAM_EPS}"]
TIED = ["--model.tie_embeddings=true"]
MOE = ["--model.num_experts=4", "--moe.top_k=2", '--lora.targets=["wq", "wv", "w1", "w2"]']  # experts adapted too
# name: (ranks, layout keys, model keys: the single-process reference is run once per model)
LAYOUTS = {
    "dp2": (2, [], []),
    "pp2-tied": (2, ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"], TIED),
    "pp2-zb-h1": (2, ["--parallel.pp=2", "--pipeline.schedule=zb-h1", "--pipeline.microbatches=2"], []),
    "zero1": (2, ["--parallel.zero_stage=1"], []),
    "zero2": (2, ["--parallel.zero_stage=2"], []),
    "zero3": (2, ["--parallel.zero_stage=3"], []),
    "zero3-recompute-tied": (2, ["--parallel.zero_stage=3", "--checkpointing.mode=full"], TIED),
    "ep2-zero3": (2, ["--parallel.ep=2", "--parallel.zero_stage=3"], MOE),
    "ep2": (2, ["--parallel.ep=2"], MOE),
    "ep2-zero1": (2, ["--parallel.ep=2", "--parallel.zero_stage=1"], MOE),
    "dp2xpp2-zero3": (4, ["--parallel.pp=2", "--parallel.zero_stage=3", "--pipeline.schedule=1f1b",
                          "--pipeline.microbatches=2"], []),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """``get(model_keys) -> (lora_run result, losses)`` of one process, made on first use."""
    out, done = tmp_path_factory.mktemp("lora-reference"), {}

    def get(model):
        key = "ref" + "".join(m.strip("-").replace(".", "-").replace("=", "-") for m in model)
        if key not in done:
            run = lora_run(lora_args(out, corpus_cache, key, [*EPS, *model]))
            run["grad_norms"] = train_losses(out / key, "grad_norm")  # the adapters' norm, clipped by it
            done[key] = (run, train_losses(out / key))
        return done[key]

    return get


def merged_adapters(results) -> dict[str, torch.Tensor]:
    """Every adapter tensor from whichever rank holds it (a pipeline's stages hold different ones; data-
    parallel replicas hold equal ones: checked)."""
    out = {}
    for r in results:
        for name, value in r["adapters"].items():
            if name in out:
                assert torch.equal(out[name], value), f"replicas of {name} differ"
            out[name] = value
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_matches_single_process(rank_pool, tmp_path, corpus_cache, references, name):
    world, layout, model = LAYOUTS[name]
    single, want_losses = references(model)
    args = lora_args(tmp_path, corpus_cache, name, [*EPS, *model, *layout])
    results = rank_pool.run(lora_worker, world, args=args)
    losses = train_losses(tmp_path / name)
    assert len(losses) == len(want_losses) == STEPS
    for step, (a, b) in enumerate(zip(want_losses, losses), 1):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-5), f"step {step}"
    assert train_losses(tmp_path / name, "grad_norm") == pytest.approx(single["grad_norms"], rel=1e-4)
    assert {r["summary"]["val_loss_end"] for r in results} == {results[0]["summary"]["val_loss_end"]}
    assert results[0]["summary"]["val_loss_end"] == pytest.approx(single["summary"]["val_loss_end"], rel=1e-5)
    assert all(r["base_change"] == 0.0 for r in results)  # the base weights never moved, on any rank
    got, want = merged_adapters(results), single["adapters"]
    assert got.keys() == want.keys()
    init = initial_values(args)
    for n in want:
        assert not torch.equal(got[n], init[n]), f"{n} did not train"
        assert_close_but_few(got[n], want[n], rtol=1e-4, atol=1e-6, loose_atol=1e-4, msg=n)


def zero3_state_bytes(summary) -> tuple[int, int, int]:
    mem = summary["memory_per_rank"]
    return max(r["params"] for r in mem), max(r["grads"] for r in mem), max(r["optimizer"] for r in mem)


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero3_holds_no_gradient_master_or_state_for_frozen_weights(rank_pool, tmp_path, corpus_cache, references,
                                                                    dtype):
    """ZeRO-3 on 2 ranks: each rank holds half of every parameter (frozen ones too) in the compute dtype, and
    gradients and optimizer state for half of the adapters only; bf16 tracks the fp32 one-process curve."""
    single, want_losses = references([])
    args = lora_args(tmp_path, corpus_cache, dtype, [*EPS, "--parallel.zero_stage=3", f"--precision.dtype={dtype}"])
    results = rank_pool.run(lora_worker, 2, args=args)
    n_all, n_adapter = results[0]["summary"]["parameters"], adapter_count(args)
    size = 2 if dtype == "bf16" else 4
    pad = 2 * 64 * 4  # each flat is padded to a multiple of 2 ranks: a few elements per flat at most
    params, grads, optimizer = zero3_state_bytes(results[0]["summary"])
    assert size * n_all / 2 <= params <= size * n_all / 2 + pad
    assert size * n_adapter / 2 <= grads <= size * n_adapter / 2 + pad  # reduced adapter slices only
    # AdamW's two fp32 moments (+ the fp32 master in bf16) for half of the adapters, and 0-d steps
    per_adapter = 12 if dtype == "bf16" else 8
    assert per_adapter * n_adapter / 2 <= optimizer <= per_adapter * n_adapter / 2 + pad
    assert optimizer < per_adapter * (n_all - n_adapter) / 2 / 5  # a state for the frozen half would be 10x this
    assert all(r["base_change"] == 0.0 for r in results)
    assert results[0]["base_dtypes"] == [str(torch.bfloat16 if dtype == "bf16" else torch.float32)]
    losses = train_losses(tmp_path / dtype)
    if dtype == "fp32":
        assert all(b == pytest.approx(a, rel=1e-5, abs=1e-5) for a, b in zip(want_losses, losses))
    else:  # computed in bf16: close to one fp32 process, yet not equal
        diff = max(abs(a - b) for a, b in zip(want_losses, losses))
        assert len(losses) == STEPS and 0 < diff < LOW_PRECISION_BOUND
        bf16, _ = references(["--precision.dtype=bf16"])
        assert bf16["base_dtypes"] == ["torch.bfloat16"] and bf16["base_change"] == 0.0
    assert all(is_adapter_name(n) for n in results[0]["adapters"])


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["2bw", "pipedream"])
def test_weight_stashing_schedules_train_the_adapters_alone(rank_pool, tmp_path, corpus_cache, references, schedule):
    """PipeDream and 2BW stash weight versions: only the trainable ones (the frozen base is shared by every
    version and gets no gradient). 2BW's first step runs on the initial weights, so its loss and gradient norm
    are one process's; a frozen weight's gradient in the norm would change it."""
    single, want_losses = references([])
    layout = ["--parallel.pp=2", f"--pipeline.schedule={schedule}", "--pipeline.microbatches=2"]
    args = lora_args(tmp_path, corpus_cache, schedule, [*EPS, *layout])
    results = rank_pool.run(lora_worker, 2, args=args)
    losses = train_losses(tmp_path / schedule)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert all(r["base_change"] == 0.0 for r in results)
    init, got = initial_values(args), merged_adapters(results)
    assert got and all(not torch.equal(got[n], init[n]) for n in got)
    if schedule == "2bw":
        assert losses[0] == pytest.approx(want_losses[0], rel=1e-5)
        assert train_losses(tmp_path / schedule, "grad_norm")[0] == pytest.approx(single["grad_norms"][0], rel=1e-4)
