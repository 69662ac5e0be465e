"""Every ``tessera …`` command in README.md and docs/*.md runs.

Commands are taken from fenced and indented code blocks and from inline code, in the forms ``tessera …``,
``python -m tessera …`` and ``torchrun … -m tessera …``. ``tessera train`` commands are dry-run in-process
(``--dry-run``: every check of a launch, nothing started); under torchrun as rank 0 of the world size
torchrun's flags give. Everything else runs for real: ``tessera plan`` (the calibration too), and
``tessera export`` on a checkpoint a real run made first. They run in document order in one scratch
folder that holds what the commands name: ``configs/`` (the repository's), a corpus at
``path/to/texts``, and the run ``runs/r1``: a real single-process run of the small preset (the model the
documented resume builds) whose two checkpoints are moved to the step numbers the docs name,
``step_000100`` and ``step_000300`` (a 300-step run costs minutes on a shared CPU; the checks at stake
read the files, tensors and optimizer state, not the step count). Absolute paths
(``/mnt/shared/runs``) are moved inside the scratch folder.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bpe_tokenizer import train_bpe
from tessera.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TORCHRUN_FLAGS = {"--standalone"}  # torchrun options without a value


def _logical_lines(lines: list[str]) -> list[str]:
    """Lines with backslash continuations joined."""
    out, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    return out + ([current] if current else [])


def _invocation(text: str) -> list[str] | None:
    """The tokens of a shell line if it invokes tessera (leading VAR=value assignments dropped)."""
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
        tokens = tokens[1:]
    if tokens[:1] == ["tessera"]:
        return tokens
    if tokens[:1] in (["torchrun"], ["python"], ["python3"]) and "-m" in tokens:
        at = tokens.index("-m")
        if tokens[at + 1:at + 2] == ["tessera"]:
            return tokens
    return None


def commands(markdown: str) -> list[list[str]]:
    """Every tessera invocation in a markdown text: code-block lines (fenced, or indented four spaces)
    and inline code spans (which may wrap across lines), in document order."""
    found, block, prose = [], [], []
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            if fenced:
                found += [(len(prose), line) for line in _logical_lines(block)]
                block = []
            fenced = not fenced
            continue
        if fenced:
            block.append(line)
        elif line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|")):
            found.append((len(prose), line))  # an indented code block line (or a list's continuation)
            prose.append(line)
        else:
            prose.append(line)
    text = "\n".join(prose)
    spans = [(text.count("\n", 0, m.start()), m.group(1).replace("\n", " "))
             for m in re.finditer(r"`([^`]+)`", text)]
    ordered = sorted([*found, *spans], key=lambda item: item[0])
    return [tokens for _, line in ordered if (tokens := _invocation(line)) is not None]


def _torchrun_world(tokens: list[str]) -> int:
    """nnodes × nproc-per-node from torchrun's options (``--nnodes 1:2`` counts its maximum)."""
    opts, i = {}, 1
    while i < len(tokens) and tokens[i] != "-m":
        name = tokens[i]
        if "=" in name:
            name, value = name.split("=", 1)
        elif name in TORCHRUN_FLAGS:
            value = ""
        else:
            value, i = tokens[i + 1], i + 1
        opts[name.replace("_", "-")] = value
        i += 1
    nnodes = int(str(opts.get("--nnodes", "1")).split(":")[-1])
    return nnodes * int(opts.get("--nproc-per-node", "1"))


def _inside(tokens: list[str], scratch: Path) -> list[str]:
    """Absolute paths moved inside the scratch folder."""
    out = []
    for tok in tokens:
        key, eq, value = tok.partition("=")
        if eq and value.startswith("/"):
            tok = f"{key}={scratch}{value}"
        elif tok.startswith("/"):
            tok = f"{scratch}{tok}"
        out.append(tok)
    return out


def run_documented(tokens: list[str], scratch: Path, monkeypatch) -> int:
    """Run one documented invocation as the test promises (train: dry-run); returns its exit code."""
    args = _inside(tokens[tokens.index("tessera") + 1:], scratch)
    with monkeypatch.context() as env:
        monkeypatch.chdir(scratch)
        for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.delenv(var, raising=False)
        if tokens[0] == "torchrun":  # this process plays rank 0 of the job torchrun would start
            env.setenv("RANK", "0")
            env.setenv("WORLD_SIZE", str(_torchrun_world(tokens)))
        if args[:1] == ["train"]:
            args = ["train", "--dry-run", *args[1:]]
        try:
            return main(args)
        except SystemExit as exit_:
            return int(exit_.code or 0)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, corpus_cache):
    """A working folder holding what the documented commands name (see the module doc)."""
    folder = tmp_path_factory.mktemp("docs")
    (folder / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    (folder / "path" / "to").mkdir(parents=True)
    (folder / "path" / "to" / "texts").write_text("A text file to train on.\n" * 400, encoding="utf-8")
    run = ["train", "--nproc", "1", "--run.name=r1", "--train.steps=2", "--checkpoint.every=1",
           "--train.eval_every=2", "--train.log_every=1", "--data.seq_len=8", "--data.global_batch_size=1",
           "--data.micro_batch_size=1", "--data.eval_batches=1", f"--data.cache_dir={corpus_cache}",
           f"--run.out_dir={folder / 'runs'}", "--run.progress=false"]
    assert main(run) == 0
    saved = folder / "runs" / "r1" / "checkpoint"
    for step, named in ((1, 100), (2, 300)):  # the manifest lists files inside the folder: renaming keeps it
        (saved / f"step_{step:06d}").rename(saved / f"step_{named:06d}")
    _bpe_run(folder, run[4:])
    assert main(["train", "--nproc", "1", "--run.name=lora", "--model.preset=tiny", "--lora.rank=8", *run[4:]]) == 0
    _sft_run(folder, run[4:])
    return folder


def _sft_run(folder: Path, settings: list[str]) -> None:
    """The README's LoRA walkthrough: prompt/response pairs (``path/to/pairs.jsonl``), a tiny Hugging Face
    Llama of the BPE tokenizer's vocabulary (``path/to/llama``), and a real run ``runs/sft`` on them."""
    import json

    import transformers

    pairs = [{"prompt": f"Q: what is {a} plus {b}?\nA:", "response": f" {a + b}"} for a in range(8) for b in range(8)]
    (folder / "path" / "to" / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "path" / "to" / "llama")
    with pytest.MonkeyPatch.context() as env:
        env.chdir(folder)
        assert main(["prepare", "path/to/pairs.jsonl", "--sft", "--tokenizer", "path/to/tokenizer",
                     "--out", "data/pairs", "--no-progress"]) == 0
        assert main(["train", "--nproc", "1", "--model.hf=path/to/llama", "--lora.rank=8", "--run.name=sft",
                     "--data.corpus=data/pairs", "--data.tokenizer=data/pairs/tokenizer", "--data.seq_len=32",
                     *[s for s in settings if not s.startswith(("--run.name", "--data.cache_dir", "--data.seq_len"))]]) == 0


def _bpe_run(folder: Path, settings: list[str]) -> None:
    """The README's walkthrough needs a BPE tokenizer (``path/to/tokenizer``, trained here) and a real run
    ``runs/bpe`` on the shards its ``tessera prepare`` writes (prepared here first with the same command,
    which then finds its folder finished)."""
    train_bpe(folder / "path" / "to" / "tokenizer")
    with pytest.MonkeyPatch.context() as env:
        env.chdir(folder)
        assert main(["prepare", "path/to/texts", "--tokenizer", "path/to/tokenizer", "--out", "data/texts-bpe",
                     "--no-progress"]) == 0
        assert main(["train", "--nproc", "1", "--model.preset=tiny", "--model.vocab_size=512", "--run.name=bpe",
                     "--data.corpus=data/texts-bpe", "--data.tokenizer=data/texts-bpe/tokenizer",
                     *[s for s in settings if not s.startswith(("--run.name", "--data.cache_dir"))]]) == 0


def test_the_docs_hold_the_commands_we_expect():
    every = [shlex.join(c) for doc in DOCS for c in commands(doc.read_text(encoding="utf-8"))]
    assert "tessera train --nproc 1 --model.preset=tiny" in every
    assert "tessera export runs/r1/checkpoint/step_000300" in every
    assert any(c.startswith("torchrun --standalone") for c in every)
    assert any(c.startswith("torchrun --nnodes 2") and "--run.out_dir=/mnt/shared/runs" in c for c in every)
    # an inline span wrapped across two lines (docs/CONFIG.md's [ps] example) is one command
    assert any(c.startswith("tessera train --model.preset=ctr --ps.servers=2 --ps.workers=2") for c in every)
    assert any(c.startswith("tessera plan --calibration cal.json") for c in every)
    assert any(c.startswith("tessera generate runs/bpe/hf") for c in every)  # the README walkthrough


def test_a_broken_documented_command_fails_the_check(tmp_path, monkeypatch, capsys):
    """The check is not vacuous: a command the CLI refuses comes back with its non-zero exit code."""
    doc = "Try `tessera train --model.n_layer=3` or\n\n```sh\ntessera plan --model no-such-model\n```\n"
    found = commands(doc)
    assert [c[:2] for c in found] == [["tessera", "train"], ["tessera", "plan"]]
    assert [run_documented(c, tmp_path, monkeypatch) for c in found] == [2, 2]
    assert "did you mean 'model.n_layers'" in capsys.readouterr().err


def test_every_documented_command_runs(scratch, monkeypatch, capsys):
    seen, failed = set(), []
    for doc in DOCS:
        for tokens in commands(doc.read_text(encoding="utf-8")):
            line = shlex.join(tokens)
            if line in seen:
                continue
            seen.add(line)
            code = run_documented(tokens, scratch, monkeypatch)
            out = capsys.readouterr()
            if code != 0:
                failed.append(f"{doc.name}: {line} -> exit {code}: {out.err.strip()[-300:]}")
    assert len(seen) >= 15
    assert not failed, "\n".join(failed)
    assert (scratch / "runs" / "r1" / "checkpoint" / "step_000300.safetensors").is_file()  # export ran
    assert (scratch / "runs" / "bpe" / "hf" / "tokenizer.json").is_file()  # the walkthrough's export ran
    assert (scratch / "runs" / "sft" / "merged" / "model.safetensors").is_file()  # and the LoRA one's
    assert (scratch / "cal.json").is_file()  # the calibration ran, and the next command read it


def test_a_runs_own_config_is_accepted_back(scratch, monkeypatch, capsys):
    """runs/<name>/config.toml lists every key resolved; --config takes it back (dry-run checks all)."""
    assert (scratch / "runs" / "r1" / "config.toml").is_file()
    assert run_documented(["tessera", "train", "--config", "runs/r1/config.toml"], scratch, monkeypatch) == 0
    assert "resume:     none" in capsys.readouterr().out
