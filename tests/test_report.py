"""``tessera report RUN``: one self-contained HTML page of a run folder, its parts checked one by one."""

import re

import pytest

from tessera.cli import main
from tessera.launch import run_rank
from tessera.train.config import load_config

IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
PNG_MAGIC = "iVBORw0KGgo"  # base64 of the PNG signature's first bytes


def tiny_args(out_dir, cache, name, extra=()):
    return ["--model.preset=tiny", "--train.steps=4", "--train.log_every=1", "--train.eval_every=2",
            "--data.seq_len=32", "--data.global_batch_size=8", "--data.micro_batch_size=2",
            "--data.eval_batches=1", f"--data.cache_dir={cache}", f"--run.out_dir={out_dir}",
            f"--run.name={name}", "--run.progress=false", "--checkpoint.save_final=false", *extra]


def trainer_worker(rank, world_size, args):
    return run_rank(load_config(None, args))


def sections(page: str) -> dict[str, str]:
    """``<h2>`` heading → the HTML up to the next heading."""
    parts = re.split(r"<h2>(.*?)</h2>", page)
    return dict(zip(parts[1::2], parts[2::2]))


def plotted(section: str) -> bool:
    """One inline PNG in the section, and nothing loaded from elsewhere."""
    images = IMG.findall(section)
    return len(images) == 1 and images[0].startswith(PNG_MAGIC) and "src=\"http" not in section


@pytest.mark.multirank
def test_report_of_a_pipeline_run_has_every_part(rank_pool, tmp_path, corpus_cache, capsys):
    args = tiny_args(tmp_path, corpus_cache, "pp", ["--parallel.pp=2", "--pipeline.schedule=gpipe",
                                                    "--pipeline.microbatches=4", "--train.time_breakdown=true"])
    rank_pool.run(trainer_worker, 2, args=args)
    out = tmp_path / "page.html"
    assert main(["report", str(tmp_path / "pp"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert "<script" not in page and "http://" not in page and "https://" not in page  # self-contained
    parts = sections(page)
    assert list(parts) == ["Summary", "Configuration", "Loss", "Throughput", "Model FLOP/s", "Memory per rank",
                           "Communication per step", "Step time split", "Pipeline timeline"]
    for heading in ("Loss", "Throughput", "Model FLOP/s", "Memory per rank", "Communication per step",
                    "Step time split", "Pipeline timeline"):
        assert plotted(parts[heading]), heading
    config = parts["Configuration"]
    for key, value in (("pipeline.schedule", "gpipe"), ("parallel.pp", "2"), ("pipeline.microbatches", "4"),
                       ("model.preset", "tiny"), ("train.steps", "4")):
        assert f"<tr><td>{key}</td><td>{value}</td></tr>" in config, key
    assert "<tr><td>world_size</td><td>2</td></tr>" in parts["Summary"]
    assert "<tr><td>bubble_fraction</td>" in parts["Summary"]


def test_report_of_a_dense_run_says_there_is_no_pipeline(tmp_path, corpus_cache):
    summary = run_rank(load_config(None, tiny_args(tmp_path, corpus_cache, "dense")))
    assert main(["report", summary["run_dir"]]) == 0
    parts = sections((tmp_path / "dense" / "report.html").read_text())  # the default place
    assert "this run has no pipeline timeline" in parts["Pipeline timeline"]
    assert not IMG.search(parts["Pipeline timeline"])
    assert "did not set train.time_breakdown" in parts["Step time split"]
    assert "issued no collectives" in parts["Communication per step"]
    for heading in ("Loss", "Throughput", "Model FLOP/s", "Memory per rank"):
        assert plotted(parts[heading]), heading
    assert "<tr><td>parallel.pp</td><td>1</td></tr>" in parts["Configuration"]


def test_report_of_a_killed_run_leaves_out_what_it_lacks(tmp_path):
    """Only metrics.jsonl, its last line cut short: no summary, no config, the rest drawn."""
    run = tmp_path / "killed"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "val_loss": 5.5}\n'
                                       '{"kind": "train", "step": 1, "loss": 5.4, "tokens_per_s": 100.0}\n'
                                       '{"kind": "train", "st')
    (run / "trace.json").write_text("{not json")
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    parts = sections(page)
    assert "no summary.json" in parts["Summary"] and "no config.toml" in parts["Configuration"]
    assert plotted(parts["Loss"]) and plotted(parts["Throughput"])
    assert "no flops_per_s" in parts["Model FLOP/s"]
    assert "no memory per rank" in parts["Memory per rank"]
    assert "trace.json could not be read" in page


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "has no metrics.jsonl"),
])
def test_report_of_no_run_is_one_sentence_and_exit_2(tmp_path, capsys, make, message):
    folder = tmp_path / "run"
    make(folder)
    assert main(["report", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera: error: ") and message in err and err.count("\n") == 1
    assert not (folder / "report.html").exists()


def test_report_into_a_missing_folder_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "val_loss": 5.5}\n')
    assert main(["report", str(run), "--out", str(tmp_path / "nowhere" / "r.html")]) == 2
    assert "folder" in capsys.readouterr().err
