"""The benchmark scripts' shared helpers (benchmarks/_common.py): what every published table states about
its numbers (command, commit, machine, load) and how it states a ratio; and that every script answers
``--help`` (its imports and options are sound without running anything)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import _common  # noqa: E402


def test_spread_is_median_with_range():
    assert _common.spread([1.0, 0.9, 1.2]) == "1.000 (0.900–1.200)"
    assert _common.spread([0.95, 1.05, 0.90, 1.10]) == "1.000 (0.900–1.100)"  # even count: mean of the middle two
    assert _common.spread([0.5], digits=2) == "0.50 (0.50–0.50)"


def test_round_order_rotates_so_no_variant_always_runs_first():
    assert [_common.round_order(["a", "b"], i) for i in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    orders = [_common.round_order({"x": 1, "y": 2, "z": 3}, i) for i in range(3)]
    assert [o[0] for o in orders] == ["x", "y", "z"] and all(sorted(o) == ["x", "y", "z"] for o in orders)


def test_command_line_names_the_script_and_its_arguments(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/somewhere/else/ddp.py", "--ranks", "2", "4", "--note", "a b"])
    assert _common.command_line() == "python benchmarks/ddp.py --ranks 2 4 --note 'a b'"


def test_provenance_states_command_commit_machine_and_load(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/moe.py", "--rounds", "7"])
    monkeypatch.setattr(_common, "git_commit", lambda: "abc1234")
    monkeypatch.setattr(_common, "_LOAD_AT_IMPORT", 3.0)
    text = _common.provenance()
    assert text.startswith("Command: `python benchmarks/moe.py --rounds 7`; commit abc1234; ")
    assert f"torch {torch.__version__}" in text
    assert f"cores ({torch.backends.cpu.get_cpu_capability()}), torch" in text  # AVX2 or AVX512: bf16 speed
    assert "1-minute load average 3.0 at the start and " in text
    assert text.endswith("cores.")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def _common_copy(root: Path):
    """_common.py copied into ``root``/benchmarks and imported from there: its git_commit() looks at ``root``."""
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(BENCH / "_common.py", root / "benchmarks" / "_common.py")
    spec = importlib.util.spec_from_file_location(f"_common_copy_{root.name}", root / "benchmarks" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")
def test_git_commit_marks_uncommitted_changes_to_tracked_files(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # never find an enclosing repository
    repo = tmp_path / "repo"
    common = _common_copy(repo)
    assert common.git_commit() == "unknown"  # not a git checkout
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert common.git_commit() == head
    (repo / "notes.txt").write_text("untracked files do not count\n")
    assert common.git_commit() == head
    with open(repo / "benchmarks" / "_common.py", "a") as f:
        f.write("# an edit\n")
    assert common.git_commit() == f"{head} with uncommitted changes"


def test_every_benchmark_script_answers_help():
    """One interpreter runs every script's ``--help`` (torch and tessera imported once): each must exit 0
    and print its usage."""
    scripts = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))
    driver = """
import contextlib, io, json, runpy, sys
results = {}
for path in sys.argv[1:]:
    sys.argv, out = [path, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        results[path] = "returned without printing usage and exiting"
    except SystemExit as e:
        results[path] = "ok" if e.code in (0, None) and "usage:" in out.getvalue() else f"exit {e.code}"
    except Exception as e:  # an import or option error: name it
        results[path] = f"{type(e).__name__}: {e}"
print(json.dumps(results))
"""
    proc = subprocess.run([sys.executable, "-c", driver, *map(str, scripts)], cwd=BENCH.parent, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(scripts) >= 10
    assert {Path(k).name: v for k, v in results.items() if v != "ok"} == {}


def test_no_benchmark_module_shadows_an_installed_one():
    """The scripts put this folder first on ``sys.path`` (and ``python benchmarks/x.py`` does too), so a script
    named like an installed top-level module replaces it for everything imported after: a ``kernels.py`` here
    broke transformers, whose integrations import the Hugging Face ``kernels`` package."""
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    outside = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    taken = {}
    for name in names:
        spec = importlib.machinery.PathFinder.find_spec(name, outside)
        if spec is not None or name in sys.builtin_module_names:
            taken[name] = getattr(spec, "origin", "built in")
    assert taken == {}
