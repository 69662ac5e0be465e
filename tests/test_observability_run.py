"""One 20-step run seen every way issue 19 promises: TensorBoard events, profiler traces of the chosen steps,
MFU and the step-time split in every metrics line, and the ``tessera report`` page with each of its parts.

The layout is pp2 (GPipe, 2 micro-batches) on 2 ranks, so the run has communication on an axis, memory on
more than one rank and a pipeline timeline: every part of the page has something to draw.
"""

import base64
import io
import json

import pytest

from tessera.cli import main
from test_observability_metrics import PEAK, read_events, trainer_worker
from test_report import IMG, sections

STEPS, LOG_EVERY, PROFILED = 20, 5, (3, 20)
SEQ, BATCH = 32, 4
PARTS = ("time_forward_backward", "time_optimizer", "time_comm_wait")  # a pipeline step's split
PAGE = ["Summary", "Configuration", "Loss", "Throughput", "Model FLOP/s", "Memory per rank",
        "Communication per step", "Step time split", "Pipeline timeline"]


def run_args(out_dir, cache):
    return ["--model.preset=tiny", f"--train.steps={STEPS}", f"--train.log_every={LOG_EVERY}",
            "--train.eval_every=10", f"--data.seq_len={SEQ}", f"--data.global_batch_size={BATCH}",
            "--data.micro_batch_size=2", "--data.eval_batches=1", f"--data.cache_dir={cache}",
            f"--run.out_dir={out_dir}", "--run.name=seen", "--run.progress=false",
            "--checkpoint.save_final=false", "--parallel.pp=2", "--pipeline.schedule=gpipe",
            "--pipeline.microbatches=2", "--run.tensorboard=true", f"--run.peak_flops={PEAK}",
            "--train.time_breakdown=true", f"--profile.steps=[{','.join(map(str, PROFILED))}]"]


def drawn(section: str):
    """The section's one inline PNG, decoded: an RGB(A) array with something drawn on it."""
    import matplotlib.image

    images = IMG.findall(section)
    assert len(images) == 1 and "src=\"http" not in section
    pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(images[0])), format="png")
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 0.01  # not a blank canvas
    return pixels


@pytest.fixture(scope="module")
def seen_run(rank_pool, tmp_path_factory, corpus_cache):
    out = tmp_path_factory.mktemp("observed")
    rank_pool.run(trainer_worker, 2, args=run_args(out, corpus_cache))
    return out / "seen"


@pytest.mark.multirank
def test_a_20_step_run_is_seen_every_way(seen_run):
    run = seen_run
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))

    # TensorBoard: the loss of every train line, at its step; validation at 0, 10, 20
    events = read_events(run / "tensorboard")
    assert events["loss"] == pytest.approx({r["step"]: r["loss"] for r in train}, rel=1e-6)
    assert set(events["val_loss"]) == {0, 10, 20} and set(events["mfu"]) == set(events["loss"])

    # a Chrome trace of each chosen step on each rank, holding that step's span
    assert sorted(p.name for p in (run / "profile").iterdir()) == sorted(
        f"rank{r}-step{s}.json" for r in (0, 1) for s in PROFILED)
    for rank in (0, 1):
        for step in PROFILED:
            trace = json.loads((run / "profile" / f"rank{rank}-step{step}.json").read_text())
            spans = [e for e in trace["traceEvents"] if e.get("name") == f"tessera step {step}"]
            assert len(spans) == 1 and spans[0]["ph"] == "X" and spans[0]["dur"] > 0

    # every train line: FLOP/s and MFU, and a split that adds up to at most the step's time
    for r in train:
        assert r["flops_per_s"] > 0 and r["mfu"] == pytest.approx(r["flops_per_s"] / PEAK)
        step_seconds = BATCH * SEQ / r["tokens_per_s"]  # the interval's mean step
        assert all(r[k] >= 0.0 for k in PARTS) and r["time_forward_backward"] > 0, r
        assert sum(r[k] for k in PARTS) <= step_seconds * (1 + 1e-9)
        assert "time_forward" not in r  # a schedule interleaves them: reported together
        assert [m["rank"] for m in r["memory"]] == [0, 1] and all(m["params"] > 0 for m in r["memory"])
        assert any(key.startswith("pp/") and stat["bytes"] > 0 for key, stat in r["comm_per_step"].items())


@pytest.mark.multirank
def test_report_page_of_the_20_step_run_has_every_part(seen_run, capsys):
    out = seen_run / "page.html"
    assert main(["report", str(seen_run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert "<script" not in page and "http://" not in page and "https://" not in page  # self-contained
    parts = sections(page)
    assert list(parts) == PAGE
    for heading in PAGE[2:]:  # loss, throughput, FLOP/s, memory per rank, bytes per axis, split, timeline
        drawn(parts[heading])
    assert f"<tr><td>steps</td><td>{STEPS}</td></tr>" in parts["Summary"]
    assert "<tr><td>world_size</td><td>2</td></tr>" in parts["Summary"]
    assert "<tr><td>bubble_fraction</td>" in parts["Summary"]
    assert "<tr><td>run.tensorboard</td><td>true</td></tr>" in parts["Configuration"].lower()
