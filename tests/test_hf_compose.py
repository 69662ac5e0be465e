"""Issue 17's pieces composed: Hugging Face models under the layouts, checkpoints and commands a user combines.

1. Mixtral from an HF folder under expert parallelism (ep2, ep2 × ZeRO-3 on 2 ranks): every rank's experts,
   dense parameters and fp32 master shards equal the one-process ``tessera.hf.load`` bit for bit, and a
   4-step fine-tune equals one process (losses rel 1e-5, gradient norms rel 1e-4, final parameters).
2. Qwen2 (q/k/v biases) from an HF folder at 2D tensor parallelism (4 ranks): a run stopped after its step-2
   checkpoint and resumed repeats the uninterrupted 3-step run exactly; ``tessera export --format hf`` of
   that checkpoint loads in ``from_pretrained`` with the one-process tessera model's logits (1e-4).
3. End to end through the commands: a BPE tokenizer trained here, ``tessera prepare`` of text files,
   ``tessera train --model.hf`` at dp2 on them, ``tessera export --format hf``, ``tessera generate`` of the
   export: its greedy tokens are transformers' greedy ``generate`` on the exported folder.
Tiny random models built locally by transformers (nothing downloaded), fp32.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tessera.hf  # noqa: E402
from tessera.cli import main  # noqa: E402
from tessera.data_parallel import DDPConfig  # noqa: E402
from tessera.generate import generate  # noqa: E402
from tessera.launch import run_rank  # noqa: E402
from tessera.models import init as init_mod  # noqa: E402
from tessera.moe.expert_parallel import global_expert_state  # noqa: E402
from tessera.parallelize import parallelize, parallelize_model_side  # noqa: E402
from tessera.topology import Topology  # noqa: E402
from tessera.train.checkpoint import load_model  # noqa: E402
from tessera.train.config import load_config, validate_config  # noqa: E402
from tessera.train.data.tokenizer import load_tokenizer  # noqa: E402
from tessera.train.optim import OptimConfig, optimizer_factory, param_groups  # noqa: E402
from tessera.train.trainer import meta_model  # noqa: E402
from tessera.zero import ZeroConfig  # noqa: E402

from bpe_tokenizer import stdlib_text, train_bpe  # noqa: E402
from test_hf_shards import finetune_args, hf_model, tokens_of  # noqa: E402
from test_resume import crash_after, records, same_records  # noqa: E402
from test_trainer import trainer_worker  # noqa: E402
from test_trainer_strategies import assert_like_single_process, metrics  # noqa: E402
from test_zero3_meta import expected_slice, full_values, global_name, masters  # noqa: E402
from tolerance import assert_close_but_few  # noqa: E402

TOL = 1e-4
CPU = torch.device("cpu")


def checkpoint_model(run_dir, step: int):
    """The run's model as one process holds it after ``step``: built as the run built it (from its saved
    config.toml), then given the checkpoint's weights (any layout)."""
    model = meta_model(load_config(str(run_dir / "config.toml")))
    init_mod.materialize(model, CPU)
    load_model(run_dir / "checkpoint" / f"step_{step:06d}", model)
    return model.eval()


def parameters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


# ---- 1. Mixtral under expert parallelism ------------------------------------------------------------

EP_LAYOUTS = {"ep2": ["--parallel.ep=2"], "ep2xzero3": ["--parallel.ep=2", "--parallel.zero_stage=3"]}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny random Mixtral folder (4 experts, top 2; 257 ids: bytes and one more)."""
    folder = tmp_path_factory.mktemp("mixtral")
    hf_model(folder, "mixtral", seed=7, vocab_size=257)
    return folder


def expert_worker(rank, world_size, folder, layout):
    """The job's model from ``folder`` put through parallelize() at ``layout``, as the trainer does: the
    values this rank holds under whole-model names (its experts renumbered), its fp32 master shards under
    ZeRO-3, and which experts it holds."""
    cfg = load_config(None, [f"--model.hf={folder}", "--parallel.timeout_s=120", *EP_LAYOUTS[layout]])
    topo = Topology.build(cfg.parallel)
    try:
        # local name → (global expert index, leaf), read off a meta copy: a ZeRO-3 engine takes the parameters
        experts = global_expert_state(parallelize_model_side(meta_model(cfg), topo))
        model, optim = meta_model(cfg), OptimConfig()
        engine = parallelize(model, topo, DDPConfig(), zero=ZeroConfig(), param_groups=lambda m: param_groups(m, optim),
                             make_optimizer=optimizer_factory(optim), device=CPU)
        held = sorted({index for index, _ in experts.values()})
        if cfg.parallel.zero_stage == 3:  # the engine holds the parameters: gather them, and its master shards
            return {"values": full_values(engine, experts), "masters": masters(engine, experts), "experts": held}
        return {"values": {global_name(n, experts): p.detach() for n, p in model.named_parameters()},
                "masters": [], "experts": held}
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_mixtral_expert_shards_equal_the_one_process_load(rank_pool, mixtral, layout):
    whole = parameters(tessera.hf.load(mixtral))
    results = rank_pool.run(expert_worker, 2, folder=str(mixtral), layout=layout, timeout=300.0)
    assert [r["experts"] for r in results] == [[0, 1], [2, 3]]  # each ep rank its own half of the experts
    for r in results:
        assert set(r["values"]) < set(whole)  # the other rank's experts are not here
        for name, value in r["values"].items():
            assert torch.equal(value, whole[name]), name
        for master, shard_rank, entries in r["masters"]:  # ZeRO-3: that slice of the one-process load
            assert master.dtype == torch.float32
            assert torch.equal(master, expected_slice(whole, entries, shard_rank, master.numel()))
    assert set().union(*(r["values"] for r in results)) == set(whole)
    if layout == "ep2xzero3":
        assert all(len(r["masters"]) > 1 for r in results)
    assert any(".experts.3." in n for n in whole) and whole["layers.0.feed_forward.router.gate.weight"].abs().max() > 0


@pytest.fixture(scope="module")
def mixtral_single(tmp_path_factory, corpus_cache, mixtral):
    out = tmp_path_factory.mktemp("mixtral_one")
    summary = run_rank(load_config(None, finetune_args(out, corpus_cache, mixtral, "one")))
    return out, summary


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_mixtral_finetune_under_expert_parallelism_matches_single_process(rank_pool, tmp_path, corpus_cache,
                                                                         mixtral, mixtral_single, layout):
    one, single = mixtral_single
    args = finetune_args(tmp_path, corpus_cache, mixtral, layout, EP_LAYOUTS[layout])
    cfg = load_config(None, args)
    validate_config(cfg, 2)
    assert cfg.model.num_experts == 4 and cfg.moe.top_k == 2
    results = rank_pool.run(trainer_worker, 2, args=args, timeout=600.0)
    assert_like_single_process(results, single, metrics(one / "one"), metrics(tmp_path / layout), 2)
    ref, got = parameters(checkpoint_model(one / "one", 4)), parameters(checkpoint_model(tmp_path / layout, 4))
    start = parameters(tessera.hf.load(mixtral))
    for name, p in ref.items():
        assert_close_but_few(got[name], p, rtol=1e-4, atol=1e-5, loose_atol=1e-3, msg=name)
    moved = [n for n in ref if ".experts." in n and not torch.equal(ref[n], start[n])]
    assert len(moved) == 3 * 4 * 2  # every expert's w1, w2, w3 in both layers trained (routing reached all)


# ---- 2. Qwen2 at 2D tensor parallelism: resume, then export ------------------------------------------

TP_2D = ["--parallel.tp=4", "--tensor_parallel.mode=2d"]


def qwen_args(out, cache, folder, name, extra=()):
    return [f"--model.hf={folder}", "--train.steps=3", "--train.log_every=1", "--train.eval_every=3",
            "--data.seq_len=16", "--data.global_batch_size=4", "--data.micro_batch_size=2",
            "--data.eval_batches=1", f"--data.cache_dir={cache}", f"--run.out_dir={out}", "--run.progress=false",
            "--optim.warmup_steps=1", "--optim.lr=1e-3", "--checkpoint.every=2", "--checkpoint.keep=5",
            f"--run.name={name}", *TP_2D, *extra]


@pytest.mark.multirank
def test_qwen2_at_2d_resumes_exactly_and_exports_to_transformers(rank_pool, tmp_path, corpus_cache, capsys):
    folder = tmp_path / "qwen2"
    hf = hf_model(folder, "qwen2-tied", seed=9, vocab_size=258, tie_word_embeddings=False)  # 2D: no tied table
    validate_config(load_config(None, qwen_args(tmp_path, corpus_cache, folder, "full")), 4)
    full = rank_pool.run(trainer_worker, 4, args=qwen_args(tmp_path, corpus_cache, folder, "full"), timeout=600.0)[0]
    assert full["layout"].startswith("4 rank(s):") and "tp=4" in full["layout"]
    crash_after(tmp_path / "full", tmp_path / "part", 2)  # what a failure after the step-2 checkpoint leaves
    again = qwen_args(tmp_path, corpus_cache, folder, "part", ["--checkpoint.resume=auto"])
    resumed = rank_pool.run(trainer_worker, 4, args=again, timeout=600.0)[0]
    assert resumed["resumed_from_step"] == 2 and resumed["val_loss_end"] == full["val_loss_end"]
    same_records(records(tmp_path / "full"), records(tmp_path / "part"))
    ours = checkpoint_model(tmp_path / "part", 3)
    uninterrupted = parameters(checkpoint_model(tmp_path / "full", 3))
    for name, p in parameters(ours).items():
        assert torch.equal(p, uninterrupted[name]), name
    bias = ours.layers["1"].attention.wk.bias.detach()
    assert not torch.equal(bias, hf.model.layers[1].self_attn.k_proj.bias.detach())  # the biases trained

    capsys.readouterr()
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "part" / "checkpoint"), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = tokens_of(vocab=258, seq=16)
    expected = logits(ours, tokens)
    torch.testing.assert_close(logits(back, tokens), expected, atol=TOL, rtol=0)
    assert not torch.allclose(logits(hf.eval(), tokens), expected, atol=TOL)  # the export holds trained weights


# ---- 3. end to end: tokenizer, prepare, train, export, generate -----------------------------------------


def write_texts(folder, n=10, size=700):
    folder.mkdir(parents=True)
    text = stdlib_text(12000)
    for i in range(n):
        (folder / f"doc{i}.txt").write_text(text[i * 1000:i * 1000 + size], encoding="utf-8")


def test_prepare_train_export_generate_like_a_user(tmp_path, capsys):
    tok_dir = train_bpe(tmp_path / "tok")  # 400 ids and <|endoftext|>: 401
    write_texts(tmp_path / "texts")
    data = tmp_path / "data"
    assert main(["prepare", str(tmp_path / "texts"), "--out", str(data), "--tokenizer", str(tok_dir),
                 "--val-fraction", "0.2", "--no-progress"]) == 0
    folder = tmp_path / "llama"
    torch.manual_seed(13)  # weights wide enough that greedy choices are not near-ties
    config = transformers.LlamaConfig(vocab_size=416, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                      initializer_range=0.2, rms_norm_eps=1e-5)
    start = transformers.LlamaForCausalLM(config).eval()
    start.save_pretrained(folder)
    run = ["train", f"--model.hf={folder}", f"--data.corpus={data}", f"--data.tokenizer={tok_dir}",
           "--run.nproc=2", "--train.steps=2", "--train.eval_every=2", "--train.log_every=1", "--data.seq_len=16",
           "--data.global_batch_size=4", "--data.micro_batch_size=1", "--data.eval_batches=1", "--optim.lr=1e-2",
           "--run.progress=false", "--run.name=user", f"--run.out_dir={tmp_path / 'runs'}"]
    assert main(run) == 0
    summary = json.loads((tmp_path / "runs" / "user" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["layout"].startswith("2 rank(s): dp_replicate=2")
    exported = tmp_path / "export"
    assert main(["export", str(tmp_path / "runs" / "user" / "checkpoint"), "--format", "hf",
                 "--out", str(exported)]) == 0
    assert (exported / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()

    tok = load_tokenizer(str(exported))
    prompt = "def wrap(text, width"
    ids = tok.encode(prompt).tolist()
    back = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert not torch.equal(back.lm_head.weight, start.lm_head.weight)  # the export holds the trained weights
    with torch.no_grad():
        out = back.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            do_sample=False, max_new_tokens=12, eos_token_id=tok.eot, pad_token_id=tok.eot)
    expected = out[0, len(ids):].tolist()
    assert generate(tessera.hf.load(exported), ids, 12, stop_ids=[tok.eot]) == expected
    new = [t for t in expected if t != tok.eot]
    assert len(new) > 3 and len(set(new)) > 1  # a decoding that could differ
    capsys.readouterr()
    assert main(["generate", str(exported), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == tok.decode(new) + "\n"
