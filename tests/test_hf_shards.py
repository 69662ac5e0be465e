"""``--model.hf=DIR``: Hugging Face weights read straight into each rank's shards.

A tensor of the folder's safetensors files is a source of initial values like a drawn one
(tessera.models.init, tessera.hf.safetensors_file): the job's model is built on the meta device, each
parameter points at its file tensor, and every strategy fills only its own part from the file, a chunk at a
time. Checked here: logits of tiny HF Llama / Qwen2 (q/k/v biases, tied) / Mixtral (MoE) models at tp2 × pp2
equal transformers'; fine-tuning at dp2 × tp2 equals one process; ZeRO-3 (dp2, dp2 × tp2) shards equal the
one-process load bit for bit and cost what a rank holds plus one chunk (two for a strided tp slice); the
CLI trains from a folder and resumes, and refuses what cannot work with one sentence and exit code 2.
Tiny random models built locally by transformers (nothing downloaded), fp32.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tessera.hf  # noqa: E402
from tessera import comm  # noqa: E402
from tessera.cli import main  # noqa: E402
from tessera.hf.safetensors_file import FileTensor, read_header  # noqa: E402
from tessera.models import init as init_mod  # noqa: E402
from tessera.models.layers import precompute_rope  # noqa: E402
from tessera.pipeline import PipelineConfig  # noqa: E402
from tessera.parallelize import parallelize_model_side  # noqa: E402
from tessera.tensor_parallel.vocab import gather_logits  # noqa: E402
from tessera.testing.alloc import AllocationMeter  # noqa: E402
from tessera.topology import ParallelConfig, Topology  # noqa: E402
from tessera.train.checkpoint import load_model  # noqa: E402
from tessera.train.config import load_config  # noqa: E402
from tessera.train.optim import OptimConfig  # noqa: E402
from tessera.train.pipeline_step import PipelineStep  # noqa: E402
from tessera.train.trainer import meta_model  # noqa: E402

from test_trainer import trainer_worker  # noqa: E402
from test_trainer_strategies import assert_like_single_process, metrics  # noqa: E402
from test_zero3_meta import (  # noqa: E402
    STRIDED_TEMPORARY_CHUNKS, TEMPORARY_CHUNKS, assert_same_tensors, build_engine, expected_slice, full_values,
    held_bytes, masters)
from tolerance import ADAM_EPS, assert_close_but_few  # noqa: E402

TOL = 1e-4
CHUNK = 100  # elements: every tensor of these shapes spans several chunks, read one at a time
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, max_position_embeddings=64, rms_norm_eps=1e-5)
FAMILIES = {  # name → (config class, model class, extra config); vocabulary 61: a padding row under tp 2
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=61, tie_word_embeddings=False, rope_theta=5000.0)),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(vocab_size=61, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(vocab_size=61, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
}


class small_chunks:
    """Set tessera.models.init.CHUNK for a block (the pool's workers live on: always restore it)."""

    def __enter__(self):
        self.before, init_mod.CHUNK = init_mod.CHUNK, CHUNK

    def __exit__(self, *exc):
        init_mod.CHUNK = self.before


def hf_model(folder, family="llama", seed=0, **over):
    """A tiny random HF model of ``family`` saved to ``folder`` (fp32); its norm weights and biases
    perturbed so a swapped or dropped one would change the logits."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**SHAPE, **extra, **over})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def tokens_of(vocab=61, seq=12):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))


# ---- the file source ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_file_tensor_reads_exactly_the_chunk(tmp_path, monkeypatch, dtype):
    from safetensors.torch import save_file

    monkeypatch.setattr(init_mod, "CHUNK", 64)
    whole = {"a": torch.randn(7, 30).to(dtype), "b": torch.randn(5).to(dtype)}
    save_file(whole, str(tmp_path / "x.safetensors"))
    tensors = read_header(tmp_path / "x.safetensors")
    a = tensors["a"]
    assert isinstance(a, FileTensor) and a.shape == (7, 30) and a.constant is None
    flat = whole["a"].float().reshape(-1)
    chunks = [a.chunk(k) for k in range(4)]  # 210 elements: 64, 64, 64, 18
    assert [c.numel() for c in chunks] == [64, 64, 64, 18] and all(c.dtype == torch.float32 for c in chunks)
    assert torch.equal(torch.cat(chunks), flat)
    region = init_mod.Region(3, (7, 20), (30, 1))  # columns 3..22, strided across chunks
    out = init_mod.Origin(a, (region,)).fill_(torch.empty(7, 20))
    assert torch.equal(out, whole["a"].float()[:, 3:23])


# ---- logits at tp2 × pp2 --------------------------------------------------------------------------


def pipeline_logits_worker(rank, world_size, folder, tokens):
    """The job's model from ``folder`` at tp2 × pp2, one eval forward: the full logits on the last stage."""
    with small_chunks():
        topo = Topology.build(ParallelConfig(pp=2, tp=2, timeout_s=120))
        try:
            cfg = load_config(None, [f"--model.hf={folder}"])
            step = PipelineStep(meta_model(cfg), PipelineConfig(schedule="1f1b", microbatches=2), topo, "cpu",
                                OptimConfig(), model_config=cfg.model, moe=cfg.moe)
            (stage,) = step.pipe.stages.values()
            stage.eval()
            pp = topo.group("pp")
            with torch.no_grad():
                if pp.rank == 0:
                    comm.send(stage(tokens).contiguous(), pp, dst=1)  # hidden states [B, S, D]
                    return None
                hidden_BSD = torch.empty(*tokens.shape, cfg.model.dim)
                comm.recv(hidden_BSD, pp, src=0)
                return gather_logits(stage(hidden_BSD), topo.group("tp"), cfg.model.vocab_size)
        finally:
            topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2xpp2_logits_equal_transformers(rank_pool, tmp_path, family):
    hf = hf_model(tmp_path, family)
    tokens = tokens_of()
    with torch.no_grad():
        expected = hf(tokens).logits
    results = rank_pool.run(pipeline_logits_worker, 4, folder=str(tmp_path), tokens=tokens, timeout=300.0)
    assert results[0] is None and results[1] is None  # the first stage's ranks hold hidden states only
    for logits in results[2:]:
        torch.testing.assert_close(logits, expected, atol=TOL, rtol=0)
    assert expected.abs().max() > 1e-2  # logits that could differ
    torch.testing.assert_close(tessera.hf.load(tmp_path).eval()(tokens).detach(), expected, atol=TOL, rtol=0)


# ---- fine-tuning at dp2 × tp2 equals one process ---------------------------------------------------


def finetune_args(out, cache, folder, name, extra=()):
    return [f"--model.hf={folder}", "--train.steps=4", "--train.log_every=1", "--train.eval_every=2",
            "--data.seq_len=32", "--data.global_batch_size=8", "--data.micro_batch_size=2",
            "--data.eval_batches=2", f"--data.cache_dir={cache}", f"--run.out_dir={out}", "--run.progress=false",
            "--optim.warmup_steps=2", "--optim.lr=1e-3", f"--optim.eps={ADAM_EPS}", f"--run.name={name}", *extra]


def final_parameters(run_dir, cfg) -> dict[str, torch.Tensor]:
    model = meta_model(cfg)
    init_mod.materialize(model, torch.device("cpu"))
    load_model(run_dir / "checkpoint" / "step_000004", model)
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.multirank
def test_finetune_dp2xtp2_matches_single_process(rank_pool, tmp_path, corpus_cache):
    from tessera.launch import run_rank

    folder = tmp_path / "hf"
    hf_model(folder, "llama", seed=5, vocab_size=257)  # bytes, and a padding row under tp 2
    single = run_rank(load_config(None, finetune_args(tmp_path, corpus_cache, folder, "one")))
    args = finetune_args(tmp_path, corpus_cache, folder, "dp2xtp2", ["--parallel.tp=2"])
    results = rank_pool.run(trainer_worker, 4, args=args, timeout=600.0)
    assert results[0]["layout"].startswith("4 rank(s): dp_replicate=2 tp=2")
    assert_like_single_process(results, single, metrics(tmp_path / "one"), metrics(tmp_path / "dp2xtp2"), 4)
    cfg = load_config(None, args)
    ref, got = final_parameters(tmp_path / "one", cfg), final_parameters(tmp_path / "dp2xtp2", cfg)
    start = {k: v.detach() for k, v in tessera.hf.load(folder).named_parameters()}
    for name, p in ref.items():
        assert_close_but_few(got[name], p, rtol=1e-4, atol=1e-5, loose_atol=1e-3, msg=name)
        # fine-tuned from the file: 4 AdamW steps of lr 1e-3 move each weight by a few 1e-3 at most
        assert (p - start[name]).abs().max() < 1e-2, name
    assert any(not torch.equal(ref[n], start[n]) for n in ref)  # and it did train


# ---- ZeRO-3 from the file: bit for bit, one chunk of temporaries ------------------------------------


def zero3_worker(rank, world_size, folder, tp):
    """ZeRO-3 (dp 2, under tp ``tp``) built from the job's meta model with file origins: the allocation of
    the build, the fp32 master slices, the gathered values, and the one-process load cut the same way."""
    with small_chunks():
        topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=2, tp=tp, zero_stage=3, timeout_s=120))
        try:
            cfg = load_config(None, [f"--model.hf={folder}"])
            with AllocationMeter() as meter:
                model = meta_model(cfg)
                if tp > 1:
                    parallelize_model_side(model, topo)
                engine = build_engine(model, topo, "fp32", 1)
            with AllocationMeter() as rope:  # the RoPE tables' float64 scratch: a constant, not a parameter's
                precompute_rope(model.cfg.head_dim, model.cfg.max_seq_len)
            real = tessera.hf.load(folder)  # the one-process load, cut by the same tp layers, for comparison
            if tp > 1:
                parallelize_model_side(real, topo)
            return {"peak": meter.peak_bytes, "held": held_bytes(engine, model), "scratch": rope.peak_bytes,
                    "masters": masters(engine, {}), "values": full_values(engine, {}),
                    "real": {n: p.detach() for n, p in real.named_parameters()}}
        finally:
            topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "dp2xtp2"])
def test_zero3_shards_from_the_file_equal_the_one_process_load(rank_pool, tmp_path, tp):
    hf_model(tmp_path, "llama", seed=2, hidden_size=64, intermediate_size=128)
    whole = {n: p.detach() for n, p in tessera.hf.load(tmp_path).named_parameters()}
    results = rank_pool.run(zero3_worker, 2 * tp, folder=str(tmp_path), tp=tp, timeout=300.0)
    chunks = TEMPORARY_CHUNKS if tp == 1 else STRIDED_TEMPORARY_CHUNKS  # a tp slice is strided
    for rank, r in enumerate(results):
        assert_same_tensors(r["values"], r["real"])  # each rank's (tp-sliced) parameters, bit for bit
        if tp == 1:
            assert_same_tensors(r["values"], whole)
            for master, shard_rank, entries in r["masters"]:  # the fp32 master shard: that slice of the load
                assert torch.equal(master, expected_slice(whole, entries, shard_rank, master.numel()))
        budget = r["held"] + chunks * 4 * CHUNK + r["scratch"]
        print(f"\ntp{tp} rank {rank}: peak {r['peak']} B, held {r['held']} B, budget {budget} B")
        assert r["peak"] <= budget, (rank, r["peak"], budget)
        # a build that read the whole model first would allocate it all: far more than the bound allows
        assert 4 * sum(v.numel() for v in whole.values()) > max(budget, 10 * (budget - r["held"]))


# ---- the command line ------------------------------------------------------------------------------


def cli_args(tmp_path, cache, folder, *extra):
    return ["train", f"--model.hf={folder}", "--train.steps=2", "--train.log_every=1", "--train.eval_every=2",
            "--data.seq_len=32", "--data.global_batch_size=4", "--data.micro_batch_size=2", "--data.eval_batches=1",
            f"--data.cache_dir={cache}", f"--run.out_dir={tmp_path / 'runs'}", "--run.progress=false", *extra]


def test_cli_trains_from_a_folder_and_resumes(tmp_path, corpus_cache, capsys):
    folder = tmp_path / "hf"
    hf_model(folder, "llama", seed=3, vocab_size=256)
    assert main([*cli_args(tmp_path, corpus_cache, folder, "--run.nproc=1", "--run.name=ft",
                          "--model.dropout=0.1")]) == 0
    run = tmp_path / "runs" / "ft"
    summary = json.loads((run / "summary.json").read_text())
    saved = (run / "config.toml").read_text()
    assert f'hf = "{folder.resolve()}"' in saved and 'preset = "hf"' in saved and summary["steps"] == 2
    cfg = load_config(str(run / "config.toml"))  # the saved config is accepted back: the same model
    assert cfg.model_hf == str(folder.resolve()) and cfg.model.dropout == 0.1 and cfg.explicit.get("model.dim") is None
    capsys.readouterr()
    assert main(["train", "--config", str(run / "config.toml"), "--train.steps=3", "--checkpoint.resume=auto"]) == 0
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 3
    # the run's config.toml lists every model key: its checkpoints describe themselves without the folder
    folder.rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["export", str(run / "checkpoint"), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    assert main(["generate", str(run / "checkpoint"), "--prompt", "def ", "--max-new-tokens", "3"]) == 0
    assert (tmp_path / "out" / "config.json").is_file()


def test_cli_dry_run_sees_the_folders_model(tmp_path, corpus_cache, capsys):
    folder = tmp_path / "hf"
    hf_model(folder, "llama", vocab_size=256, hidden_size=96, intermediate_size=160)
    assert main([*cli_args(tmp_path, corpus_cache, folder, "--run.nproc=2", "--parallel.tp=2", "--dry-run")]) == 0
    report = capsys.readouterr().out
    n = sum(p.numel() for p in tessera.hf.load(folder).parameters())
    assert f"hf ({folder.resolve()}), {n / 1e3:.1f}k parameters (2 layers, dim 96)" in report, report


def test_model_hf_chooses_the_model_so_the_demo_layout_stays_off(monkeypatch):
    from tessera.cli import build_parser, with_demo_layout

    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    args, rest = build_parser().parse_known_args(["train", "--model.hf=some/folder"])
    assert with_demo_layout(args, rest) == rest  # the demo's tp2 × pp2 need not fit the folder's model


def _edit_config(folder, **change):
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))


REFUSALS = {  # name → (how the folder or the command is spoiled, words of the sentence)
    "missing folder": (lambda f: None, ["no-such-folder", "not a folder"]),
    "unsupported config": (lambda f: _edit_config(f, hidden_act="gelu"), ["'hidden_act'"]),
    "shape mismatch": (lambda f: _edit_config(f, intermediate_size=40), ["has shape", "but its config implies"]),
    "missing tensor": (lambda f: _edit_config(f, num_hidden_layers=3), ["do not match the model its config describes", "missing"]),
    "contradicting key": (lambda f: None, ["model.dim=64 contradicts", "model.dropout"]),
    "preset and hf": (lambda f: None, ["model.preset='tiny' and model.hf"]),
}
EXTRA = {"contradicting key": ["--model.dim=64"], "preset and hf": ["--model.preset=tiny"]}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_cli_refuses_with_one_sentence(tmp_path, corpus_cache, capsys, name):
    folder = tmp_path / "hf"
    hf_model(folder, "llama", vocab_size=256)
    spoil, words = REFUSALS[name]
    spoil(folder)
    capsys.readouterr()  # transformers' own progress bar while saving
    target = tmp_path / "no-such-folder" if name == "missing folder" else folder
    assert main([*cli_args(tmp_path, corpus_cache, target, "--run.nproc=2", *EXTRA.get(name, []))]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: ") and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written
