"""LoRA checkpoints hold the adapters alone, resume at any layout, and export as a merged model or a PEFT adapter.

1. A LoRA run's checkpoint holds exactly the adapters and their AdamW state: its data files are about
   3 × the adapters' bytes (value, exp_avg, exp_avg_sq), far below the base model's.
2. Stopped after step 3 and resumed under another layout, a LoRA run continues the uninterrupted run
   (losses rel 1e-5): the base comes back from the seed (or ``model.hf``), the adapters from the checkpoint.
3. ``tessera export --merge-lora --format hf`` loads in ``from_pretrained`` with the unmerged tessera model's
   logits (1e-4); ``--format peft`` loads in ``PeftModel.from_pretrained`` on the base folder (1e-5);
   ``tessera generate`` decodes the merged model; every misuse is one sentence and exit code 2.
Tiny shapes, fp32, byte tokenizer; Hugging Face models built locally (nothing downloaded).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint import checkpoint_tensors
from tessera.cli import main
from tessera.generate import generate
from tessera.generate.run_model import adapted_model, run_config
from tessera.launch import run_rank
from tessera.lora import adapter_parameters, is_adapter_name
from tessera.models.init import materialize
from tessera.train.config import load_config
from tessera.train.data import ByteTokenizer
from tessera.train.trainer import meta_model

from test_hf_shards import finetune_args, hf_model
from test_resume import args as resume_args
from test_resume import records
from test_trainer import trainer_worker

LORA = ["--lora.rank=4", "--lora.alpha=8", "--lora.targets=[\"wq\",\"wv\",\"wo\",\"w2\"]", "--optim.lr=1e-2"]
STEP3 = "checkpoint/step_000003"


def lora_run(tmp_path, cache, name, extra=()):
    """A single-process tiny LoRA run of 8 steps with checkpoints at 3, 6, 8; returns its summary."""
    return run_rank(load_config(None, resume_args(tmp_path, cache, name, [*LORA, *extra])))


def one_process_model(run_dir, step: int):
    """The run's model after ``step``, adapters not merged (base from the seed or model.hf)."""
    path = run_dir / "checkpoint" / f"step_{step:06d}"
    return adapted_model(run_config(path), path).eval()


def data_bytes(checkpoint) -> int:
    return sum(f.stat().st_size for f in checkpoint.glob("*.distcp"))


def tokens(vocab=256, seq=24):
    return torch.randint(1, vocab, (2, seq), generator=torch.Generator().manual_seed(7))


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


def test_lora_checkpoint_holds_the_adapters_and_their_adam_state_only(tmp_path, corpus_cache):
    wider = ["--model.dim=128", "--model.ffn_hidden_dim=256", "--train.steps=3"]  # weights outweigh framing
    lora_run(tmp_path, corpus_cache, "one", wider)
    path = tmp_path / "one" / STEP3
    model = meta_model(run_config(path))
    adapters = {n: tuple(p.shape) for n, p in adapter_parameters(model).items()}
    saved = checkpoint_tensors(path)
    assert {n.removeprefix("model/"): s for n, s in saved.items() if n.startswith("model/")} == adapters
    for name in adapters:
        assert saved[f"optim/{name}/exp_avg"] == saved[f"optim/{name}/exp_avg_sq"] == adapters[name]
    assert all(n.startswith(("model/", "optim/")) for n in saved)
    assert len(saved) == 4 * len(adapters)  # value, exp_avg, exp_avg_sq, step
    adapter_bytes = 4 * sum(torch.Size(s).numel() for s in adapters.values())
    on_disk = data_bytes(path)
    assert 3 * adapter_bytes <= on_disk <= 3 * adapter_bytes + 2048 * len(saved)  # + torch.save's framing
    # the same run without LoRA saves the whole model and its state: the base's bytes, three times over
    run_rank(load_config(None, resume_args(tmp_path, corpus_cache, "full", wider)))
    base_bytes = 4 * sum(p.numel() for n, p in model.named_parameters() if n not in adapters)
    assert data_bytes(tmp_path / "full" / STEP3) >= 3 * base_bytes > 10 * on_disk
    print(f"checkpoint data: LoRA {on_disk} bytes (adapters {adapter_bytes}), full "
          f"{data_bytes(tmp_path / 'full' / STEP3)} bytes (base {base_bytes})")


RESHARD = {  # saved under one layout (world, overrides), resumed under another
    "single-to-dp2": ((1, []), (2, [])),
    "dp2-to-single": ((2, []), (1, [])),
    "zero3-to-tp2": ((2, ["--parallel.zero_stage=3"]), (2, ["--parallel.tp=2"])),
    "tp2-to-zero2": ((2, ["--parallel.tp=2"]), (2, ["--parallel.zero_stage=2"])),
    "pp2-to-single": ((2, ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=4"]), (1, [])),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(RESHARD))
def test_lora_resume_on_another_layout_continues_the_run(rank_pool, tmp_path, corpus_cache, name):
    (world_a, extra_a), (world_b, extra_b) = RESHARD[name]

    def run(world, run_name, extra):
        cli = resume_args(tmp_path, corpus_cache, run_name, [*LORA, *extra])
        return run_rank(load_config(None, cli)) if world == 1 else rank_pool.run(trainer_worker, world, args=cli)[0]

    full = run(world_a, "full", extra_a)
    resumed = run(world_b, "next", [*extra_b, f"--checkpoint.resume={tmp_path / 'full' / STEP3}"])
    assert resumed["resumed_from_step"] == 3
    assert resumed["val_loss_end"] == pytest.approx(full["val_loss_end"], rel=1e-5)
    before = {r["step"]: r for r in records(tmp_path / "full") if r["kind"] == "train"}
    after = [r for r in records(tmp_path / "next") if r["kind"] == "train"]
    assert [r["step"] for r in after] == list(range(4, 9))
    for r in after:
        assert r["loss"] == pytest.approx(before[r["step"]]["loss"], rel=1e-5)


def test_resume_between_lora_and_full_runs_is_refused_before_launch(tmp_path, corpus_cache, capsys):
    lora_run(tmp_path, corpus_cache, "lora")
    run_rank(load_config(None, resume_args(tmp_path, corpus_cache, "full", ["--train.steps=3"])))
    cases = [(tmp_path / "lora" / STEP3, [], "holds no tensor model/tok_embeddings.weight"),
             (tmp_path / "full" / STEP3, LORA, "holds no tensor model/layers.0.attention.wq.lora_A.weight")]
    for path, extra, message in cases:
        cli = resume_args(tmp_path, corpus_cache, "again", [*extra, f"--checkpoint.resume={path}"])
        assert main(["train", *cli]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert not (tmp_path / "again").exists()


def test_merged_export_and_generate(tmp_path, corpus_cache, capsys):
    lora_run(tmp_path, corpus_cache, "run", ["--train.steps=3"])
    checkpoint = tmp_path / "run" / "checkpoint"
    ours = one_process_model(tmp_path / "run", 3)
    expected = logits(ours, tokens())
    assert main(["export", str(checkpoint), "--merge-lora", "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert "LoRA merged" in capsys.readouterr().out
    transformers = pytest.importorskip("transformers")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits(back, tokens()), expected, atol=1e-4, rtol=0)
    base = meta_model(run_config(checkpoint / "step_000003"))  # its adapters start with B = 0: the base model
    materialize(base, torch.device("cpu"))
    assert not torch.allclose(logits(base.eval(), tokens()), expected, atol=1e-3)

    # --merge-lora with safetensors: tessera's names, the base's parameters only, merged
    assert main(["export", str(checkpoint), "--merge-lora", "--out", str(tmp_path / "m.safetensors")]) == 0
    merged = load_file(tmp_path / "m.safetensors")
    assert sorted(merged) == sorted(n for n, _ in base.named_parameters() if not is_adapter_name(n))
    torch.testing.assert_close(merged["layers.0.feed_forward.w1.weight"],  # not adapted: the base's own
                               base.get_parameter("layers.0.feed_forward.w1.weight").detach(), atol=0, rtol=0)
    layer = ours.get_submodule("layers.1.attention.wo")
    want = layer.weight + layer.lora_scale * layer.lora_B.weight @ layer.lora_A.weight
    torch.testing.assert_close(merged["layers.1.attention.wo.weight"], want.detach(), atol=1e-6, rtol=0)

    # tessera generate of the LoRA checkpoint = greedy decoding of the unmerged model
    prompt = "def parse(self):\n    "
    capsys.readouterr()
    assert main(["generate", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "10"]) == 0
    new = generate(ours, ByteTokenizer().encode(prompt).tolist(), 10, stop_ids=(ByteTokenizer.eot,))
    new = [t for t in new if t != ByteTokenizer.eot]
    assert capsys.readouterr().out == ByteTokenizer().decode(new) + "\n" and len(new) > 3


def test_peft_export_of_an_hf_finetune_loads_in_peft(tmp_path, corpus_cache, capsys):
    """``--model.hf`` + LoRA: the checkpoint's adapter, written in PEFT format, on transformers' base model
    gives the tessera model's logits; so does the merged Hugging Face export."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    hf_model(tmp_path / "base", "llama", seed=5, vocab_size=257)
    run_rank(load_config(None, finetune_args(tmp_path, corpus_cache, tmp_path / "base", "ft", LORA)))
    checkpoint = tmp_path / "ft" / "checkpoint"
    ours = one_process_model(tmp_path / "ft", 4)
    expected = logits(ours, tokens())
    assert main(["export", str(checkpoint), "--format", "peft", "--out", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert sorted(config["target_modules"]) == ["down_proj", "o_proj", "q_proj", "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    plain = logits(base, tokens())
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(theirs, tokens()), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(plain, expected, atol=1e-3)
    assert main(["export", str(checkpoint), "--merge-lora", "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits(merged, tokens()), expected, atol=1e-4, rtol=0)


def test_export_misuse_is_one_sentence(tmp_path, corpus_cache, capsys):
    lora_run(tmp_path, corpus_cache, "lora", ["--train.steps=3"])
    run_rank(load_config(None, resume_args(tmp_path, corpus_cache, "full", ["--train.steps=3"])))
    lora, full = str(tmp_path / "lora" / "checkpoint"), str(tmp_path / "full" / "checkpoint")
    cases = [([lora, "--format", "hf"], "add --merge-lora"),
             ([lora, "--format", "peft", "--merge-lora"], "give one of them"),
             ([full, "--merge-lora"], "holds no LoRA adapters"),
             ([full, "--format", "peft"], "holds no LoRA adapters")]
    for argv, message in cases:
        assert main(["export", *argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()


def test_resume_with_other_adapters_or_another_base_is_refused(tmp_path, corpus_cache, capsys):
    """The tensors of a LoRA checkpoint would load into a job with another alpha, other targets or another base
    (the base is not saved): the checkpoint's record refuses each before launch, and export/generate too."""
    lora_run(tmp_path, corpus_cache, "lora")
    saved = tmp_path / "lora" / STEP3
    changed = [(["--lora.alpha=64"], "lora.alpha=8.0"), (["--run.seed=7"], "another base model"),
               ([], None)]  # the unchanged job resumes
    for extra, message in changed:
        cli = resume_args(tmp_path, corpus_cache, "again", [*LORA, *extra, f"--checkpoint.resume={saved}",
                                                            "--train.steps=4"])
        code = main(["train", *cli])
        err = capsys.readouterr().err
        if message is None:
            assert code == 0, err
        else:
            assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    config = tmp_path / "lora" / "config.toml"
    config.write_text(config.read_text().replace("seed = ", "seed = 1", 1))  # the run's own seed, altered
    assert main(["export", str(tmp_path / "lora" / "checkpoint"), "--merge-lora", "--out", str(tmp_path / "m")]) == 2
    assert "another base model" in capsys.readouterr().err
