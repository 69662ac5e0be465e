"""tessera.generate: KV-cache decoding equals the full forward, greedy decoding equals transformers' greedy
``generate``, top-p sampling keeps to its nucleus and repeats itself for a seed, and ``tessera generate``
on a checkpoint prints what the library decodes. One process, fp32, tiny models built locally.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint import export_safetensors
from tessera.cli import main
from tessera.generate import KVCache, Sampling, generate, nucleus_probs
from tessera.launch import run_rank
from tessera.models.config import model_config
from tessera.models.llama import Transformer
from tessera.models.moe import MoEConfig
from tessera.train.config import load_config
from tessera.train.data import ByteTokenizer

from test_trainer import tiny_args

MODELS = {  # (ModelConfig overrides of the tiny preset, MoEConfig or None)
    "gqa": (dict(), None),
    "tied-qkv-bias": (dict(tie_embeddings=True, qkv_bias=True), None),
    "moe": (dict(num_experts=4, moe_every=1), MoEConfig(drop_tokens=False)),
}


def _model(kind, seed=3):
    overrides, moe = MODELS[kind]
    model = Transformer(model_config("tiny", **overrides), moe, seed=seed).eval()
    with torch.no_grad():  # biases and norms start at zeros / ones, where a dropped one would not show
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def _ids(n, vocab=256, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("chunks", [[1] * 20, [7] + [1] * 13, [5, 6, 1, 8]], ids=["1", "7", "5-6-1-8"])
def test_kv_cache_logits_equal_the_full_forward(kind, chunks):
    """The 20 tokens in forwards of ``chunks`` tokens each (a prompt, then one token per forward; or
    several tokens after cached ones): every position's logits equal the full forward's."""
    model = _model(kind)
    tokens_BS = torch.tensor([_ids(20)])
    with torch.no_grad():
        full_BSV = model(tokens_BS)
        cache = KVCache.for_model(model, batch=1, max_len=20)
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        parts = [model(tokens_BS[:, a:a + n], cache=cache) for a, n in zip(starts, chunks)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full_BSV, atol=1e-5, rtol=0)
    assert full_BSV.abs().max() > 0.1  # logits that could differ


def test_the_cache_refuses_a_position_past_its_end():
    model = _model("gqa")
    cache = KVCache.for_model(model, batch=1, max_len=4)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 4 positions"):
        model(torch.tensor([_ids(5)]), cache=cache)


def test_nucleus_keeps_the_smallest_set_holding_top_p():
    logits_V = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    torch.testing.assert_close(nucleus_probs(logits_V, 1.0, 0.7), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(nucleus_probs(logits_V, 1.0, 0.9), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    torch.testing.assert_close(nucleus_probs(logits_V, 1.0, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(nucleus_probs(logits_V, 1.0, 1e-6), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    hot = nucleus_probs(logits_V, 2.0, 1.0)  # temperature 2: p ∝ sqrt(p)
    torch.testing.assert_close(hot, torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt() / torch.tensor(
        [0.5, 0.3, 0.15, 0.05]).sqrt().sum())


def test_top_p_draws_only_from_the_nucleus_in_proportion():
    from tessera.generate.sampling import next_token

    logits_V = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([next_token(logits_V, Sampling(temperature=1.0, top_p=0.7), g) for _ in range(2000)])
    assert set(draws.tolist()) == {1, 3}
    assert abs(float((draws == 1).float().mean()) - 0.625) < 0.04


def test_top_p_is_deterministic_for_a_seed_and_greedy_as_p_goes_to_0():
    model, prompt = _model("gqa"), _ids(5)
    greedy = generate(model, prompt, 12)
    sampled = [generate(model, prompt, 12, Sampling(temperature=1.0, top_p=0.95, seed=s)) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 12
    assert sampled[0] != sampled[2] and sampled[0] != greedy
    assert generate(model, prompt, 12, Sampling(temperature=1.0, top_p=1e-9, seed=5)) == greedy


def test_generation_stops_after_a_stop_token():
    model, prompt = _model("gqa"), _ids(5)
    free = generate(model, prompt, 12)
    stop = free[4]
    first = free.index(stop)
    assert generate(model, prompt, 12, stop_ids=[stop]) == free[:first + 1]


def _hf_family(family, path):
    """A tiny random transformers model of ``family`` (weights wide enough that greedy choices are not
    near-ties), saved to ``path``."""
    transformers = pytest.importorskip("transformers")
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "mixtral": ("MixtralConfig", "MixtralForCausalLM")}[family]
    config_cls, model_cls = (getattr(transformers, n) for n in names)
    extra = dict(num_local_experts=4, num_experts_per_tok=2) if family == "mixtral" else {}
    torch.manual_seed(11)
    cfg = config_cls(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                     initializer_range=0.2, rms_norm_eps=1e-5, eos_token_id=60, bos_token_id=59, **extra)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
def test_greedy_equals_transformers_generate(tmp_path, family):
    import tessera.hf

    hf = _hf_family(family, tmp_path)
    ours = tessera.hf.load(tmp_path)
    seen = []
    for seed in (0, 1, 2):
        prompt = _ids(6, vocab=59, seed=seed)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                              do_sample=False, max_new_tokens=20, eos_token_id=60, pad_token_id=60)
        expected = out[0, 6:].tolist()
        assert generate(ours, prompt, 20, stop_ids=[60]) == expected  # eos (60) ends both alike
        seen += expected
    assert len(seen) >= 20 and len(set(seen)) > 5  # decodings that could differ, not one token over and over


# ---- the command, on a checkpoint a (single-process) run wrote --------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_cache):
    out = tmp_path_factory.mktemp("gen")
    run_rank(load_config(None, tiny_args(out, corpus_cache, steps=2, extra=["--run.name=g"])))
    return out / "g" / "checkpoint"


def _reference_model(checkpoint, tmp_path):
    """The trained model as a plain Transformer given the exported single-process weights."""
    cfg = load_config(str(checkpoint.parent / "config.toml"))
    model = Transformer(cfg.model, seed=0)
    model.load_state_dict(load_file(export_safetensors(checkpoint / "step_000002", tmp_path / "w.safetensors")))
    return model.eval()


def test_cli_prints_the_greedy_continuation(trained, tmp_path, capsys):
    prompt = "def main():\n    "
    ids = generate(_reference_model(trained, tmp_path), ByteTokenizer().encode(prompt).tolist(), 10,
                   stop_ids=[ByteTokenizer.eot])
    expected = ByteTokenizer().decode([t for t in ids if t != ByteTokenizer.eot])
    assert main(["generate", str(trained), "--prompt", prompt, "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_cli_sampling_repeats_for_a_seed(trained, capsys):
    runs = []
    for seed in ("4", "4", "9"):
        args = ["generate", str(trained / "step_000002"), "--prompt", "import ", "--max-new-tokens", "16",
                "--top-p", "0.9", "--temperature", "1.5", "--seed", seed]
        assert main(args) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("case,words", [
    ("missing", "does not exist"),
    ("not-a-model", "neither a Hugging Face model folder"),
    ("long-prompt", "exceed the model's max_seq_len of 64"),
    ("top-p", "--top-p must be in (0, 1]"),
    ("hf-without-tokenizer", "holds no tokenizer.json"),
])
def test_cli_errors_are_one_sentence(trained, tmp_path, capsys, case, words):
    path, extra = str(trained), []
    if case == "missing":
        path = str(tmp_path / "nowhere")
    elif case == "not-a-model":
        path = str(tmp_path)
    elif case == "long-prompt":
        extra = ["--prompt", "x" * 60]
    elif case == "top-p":
        extra = ["--top-p", "0"]
    elif case == "hf-without-tokenizer":
        _hf_family("llama", tmp_path / "hf")
        path = str(tmp_path / "hf")
    capsys.readouterr()  # what building a model printed
    assert main(["generate", path, "--prompt", "hi", "--max-new-tokens", "8", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tessera: error:") and words in err, err


def _bpe_tokenizer(folder, vocab_size=120):
    """A BPE tokenizer.json trained here on a few KB of the standard library's source."""
    import inspect
    import json as json_module

    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train_from_iterator([inspect.getsource(json_module)[:8000]], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


def _llama_beside(tok, folder, seed):
    """A tiny random HF Llama of ``tok``'s vocabulary, ending at its <|endoftext|>, saved to ``folder``."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                   max_position_embeddings=64, initializer_range=0.2,
                                   eos_token_id=tok.token_to_id("<|endoftext|>"))
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(folder)
    return hf


def test_cli_on_a_hugging_face_folder_equals_transformers_greedy(tmp_path, capsys):
    """HFDIR: the model through tessera.hf.load, the prompt through the folder's tokenizer.json, decoding
    until its end-of-text token; the printed text is what transformers' greedy generate decodes to."""
    transformers = pytest.importorskip("transformers")
    from tessera.train.data.tokenizer import load_tokenizer

    tok = _bpe_tokenizer(tmp_path)
    eot = tok.token_to_id("<|endoftext|>")
    hf = _llama_beside(tok, tmp_path, seed=5)
    prompt = "def dumps(obj, indent"
    ids = load_tokenizer(str(tmp_path)).encode(prompt).tolist()
    assert ids == tok.encode(prompt, add_special_tokens=False).ids and len(ids) > 3
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=12, eos_token_id=eot, pad_token_id=eot)
    new = [t for t in out[0, len(ids):].tolist() if t != eot]
    capsys.readouterr()
    assert main(["generate", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == tok.decode(new, skip_special_tokens=False) + "\n"
    assert len(new) > 2


def test_a_hugging_face_folders_prompt_is_encoded_as_transformers_does(tmp_path, capsys):
    """A tokenizer whose post-processor adds a BOS (Llama, Mistral): the prompt of an HF folder gets it, as
    transformers' tokenizer gives it, and the printed text is transformers' greedy continuation of those ids."""
    transformers = pytest.importorskip("transformers")
    import tokenizers

    from tessera.generate.run_model import load_run_model

    tok = _bpe_tokenizer(tmp_path)
    tok.add_special_tokens(["<s>"])
    bos, eot = tok.token_to_id("<s>"), tok.token_to_id("<|endoftext|>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = _llama_beside(tok, tmp_path, seed=6)
    prompt = "def dumps(obj, indent"
    ids = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))(prompt).input_ids
    assert ids[0] == bos and load_run_model(tmp_path).encode_prompt(prompt) == ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=8, eos_token_id=eot, pad_token_id=eot)
    new = [t for t in out[0, len(ids):].tolist() if t != eot]
    capsys.readouterr()
    assert main(["generate", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == tok.decode(new, skip_special_tokens=False) + "\n"
