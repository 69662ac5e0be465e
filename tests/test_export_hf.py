"""``tessera export CKPT --format hf``: a checkpoint of any layout as a Hugging Face folder whose
``from_pretrained`` model gives the one-process tessera model's logits (within 1e-4, fp32), and whose greedy
``generate`` gives what ``tessera generate`` prints from the checkpoint itself.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint import export_safetensors
from tessera.cli import main
from tessera.launch import run_rank
from tessera.models.llama import Transformer
from tessera.train.config import load_config
from tessera.train.data import ByteTokenizer

from test_trainer import tiny_args, trainer_worker

transformers = pytest.importorskip("transformers")

TOL = 1e-4
TP2_PP2 = ["--parallel.tp=2", "--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=4"]


def one_process_model(run_dir, tmp_path):
    """The run's model as one plain Transformer holding the checkpoint's consolidated weights."""
    cfg = load_config(str(run_dir / "config.toml"))
    model = Transformer(cfg.model, cfg.moe if cfg.model.num_experts else None, seed=0)
    weights = load_file(export_safetensors(run_dir / "checkpoint" / "step_000002", tmp_path / "w.safetensors"))
    if cfg.model.tie_embeddings:
        weights["output.weight"] = weights["tok_embeddings.weight"]
    model.load_state_dict(weights)
    return model.eval()


def logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def tokens(n=2, seq=24):
    return torch.randint(1, 256, (n, seq), generator=torch.Generator().manual_seed(7))


@pytest.mark.multirank
def test_export_hf_of_a_tp2_pp2_checkpoint_matches_one_process(rank_pool, tmp_path, corpus_cache, capsys):
    rank_pool.run(trainer_worker, 4, args=tiny_args(tmp_path, corpus_cache, steps=2,
                                                    extra=["--run.name=tp2pp2", *TP2_PP2]))
    run = tmp_path / "tp2pp2"
    assert main(["export", str(run / "checkpoint"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert "config.json" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = one_process_model(run, tmp_path)
    expected = logits(ours, tokens())
    torch.testing.assert_close(logits(back, tokens()), expected, atol=TOL, rtol=0)
    fresh = Transformer(ours.cfg, seed=0).eval()  # the export holds trained weights, not initial ones
    assert not torch.allclose(logits(fresh, tokens()), expected, atol=TOL)

    # greedy decoding of the exported folder (transformers) = `tessera generate` of the checkpoint
    prompt = "class Parser:\n    def "
    ids = ByteTokenizer().encode(prompt).tolist()
    with torch.no_grad():
        out = back.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            do_sample=False, max_new_tokens=12, eos_token_id=ByteTokenizer.eot,
                            pad_token_id=ByteTokenizer.eot)
    new = [t for t in out[0, len(ids):].tolist() if t != ByteTokenizer.eot]
    capsys.readouterr()
    assert main(["generate", str(run / "checkpoint"), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == ByteTokenizer().decode(new) + "\n"
    assert len(new) > 3


def test_export_hf_of_an_moe_checkpoint_is_mixtral(tmp_path, corpus_cache):
    moe = ["--model.num_experts=4", "--model.moe_every=1", "--moe.drop_tokens=false"]
    run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, steps=2, extra=["--run.name=moe", *moe])))
    run = tmp_path / "moe"
    assert main(["export", str(run / "checkpoint" / "step_000002"), "--format", "hf",
                 "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits(back, tokens()), logits(one_process_model(run, tmp_path), tokens()),
                               atol=TOL, rtol=0)


def test_export_hf_default_folder_and_errors(tmp_path, corpus_cache, capsys):
    run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, steps=2, extra=["--run.name=one"])))
    checkpoint = tmp_path / "one" / "checkpoint"
    assert main(["export", str(checkpoint), "--format", "hf"]) == 0
    assert (checkpoint / "step_000002-hf" / "model.safetensors").is_file()  # beside the newest checkpoint
    config = json.loads((checkpoint / "step_000002-hf" / "config.json").read_text())
    assert config["eos_token_id"] == ByteTokenizer.eot  # transformers' generate stops where tessera's does
    capsys.readouterr()
    (tmp_path / "a-file").write_text("")
    assert main(["export", str(checkpoint), "--format", "hf", "--out", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a file" in err
    assert main(["export", str(tmp_path / "nowhere"), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere" in err
    (tmp_path / "one" / "config.toml").unlink()
    assert main(["export", str(checkpoint), "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.toml is missing" in err
    assert not (tmp_path / "x").exists()


def test_export_hf_carries_the_runs_tokenizer(tmp_path, corpus_cache, capsys):
    """A run that trained with a tokenizer.json: the export holds it, and transformers' tokenizer loads it."""
    from tessera.generate import generate
    from tessera.train.data.tokenizer import load_tokenizer

    from test_generate import _bpe_tokenizer

    _bpe_tokenizer(tmp_path / "tok")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over it. " * 40)
    run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, steps=2, extra=[
        "--run.name=bpe", f"--data.tokenizer={tmp_path / 'tok'}", f"--data.corpus={corpus}"])))
    assert main(["export", str(tmp_path / "bpe" / "checkpoint"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    ours = load_tokenizer(str(tmp_path / "tok"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    assert fast("the quick fox")["input_ids"] == ours.encode("the quick fox").tolist()

    # `tessera generate` of that checkpoint tokenises with the run's tokenizer and stops at its eot
    prompt_ids = ours.encode("the quick brown").tolist()
    new = generate(one_process_model(tmp_path / "bpe", tmp_path), prompt_ids, 8, stop_ids=[ours.eot])
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "bpe" / "checkpoint"), "--prompt", "the quick brown",
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == ours.decode([t for t in new if t != ours.eot]) + "\n"
