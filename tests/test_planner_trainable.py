"""One validity rule for the trainer, ``--parallel.auto`` and ``tessera plan``.

- Every layout the local search ranks for ``parallel.auto`` on 8 ranks (tiny and small presets; the whole
  ranked list, not only the winner) trains 2 steps through the trainer and equals one process (fp32:
  losses rel 1e-5, gradient norms rel 1e-4). The list is whatever the trainer's rule accepts when the
  test runs: nothing here names which pairings are legal.
- ``tessera plan`` for a catalogue model ranks only layouts the trainer accepts and prints each as the
  ``tessera train`` flags that load back (``load_config``) into that very layout.
"""

import json
import re

import pytest

from tessera.cli import main
from tessera.composition import validate_composition
from tessera.errors import ConfigError
from tessera.planner import NoLayoutFits, get_gpu, get_model, search
from tessera.planner.trainable import TrainerRule, job_flags
from tessera.train.auto_layout import apply_auto_layout, ranked_layouts
from tessera.train.config import config_dict, load_config, validate_config
from tessera.train.dry_run import planner_layout

from test_trainer import trainer_worker
from test_trainer_strategies import assert_like_single_process, metrics, single_process_runs

WORLD = 8
# the small preset keeps its 4 layers: with 2, its pp=4 layouts (one layer per stage) would leave the list
PRESETS = ("tiny", "small")
JOB = ["--train.steps=2", "--data.seq_len=32", "--data.global_batch_size=8"]


def job_args(preset, out_dir=None, cache=None, extra=()):
    """The job the search plans for, plus what makes a run quick (one eval batch, no checkpoint)."""
    args = [f"--model.preset={preset}", *JOB, "--train.log_every=1", "--data.eval_batches=1",
            "--checkpoint.save_final=false", "--run.progress=false", *extra]
    if out_dir is not None:
        args += [f"--run.out_dir={out_dir}", f"--data.cache_dir={cache}"]
    return args


TOP = 10  # what the search returns: its ranked top layouts (`tessera plan`'s default --top)


def auto_candidates():
    """(preset, Layout) for every layout the search returns for this job, fastest first."""
    out = []
    for preset in PRESETS:
        cfg = load_config(None, job_args(preset, extra=["--parallel.auto=true"]))
        for est in ranked_layouts(cfg, WORLD, top=TOP):
            out.append((preset, est.layout))
    return out


CANDIDATES = auto_candidates()


def case_id(preset, layout):
    return preset + "-" + re.sub(r"\W+", "_", layout.describe().replace("=", ""))


def layout_args(preset, layout):
    """The config parallel.auto writes for ``layout``, as flags (the job's own keys unchanged)."""
    from tessera.planner.local import as_degrees
    from tessera.train.auto_layout import chosen_settings

    chosen = chosen_settings(as_degrees(layout))
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in chosen.items()]


def test_the_search_ranks_layouts_and_parallel_auto_takes_the_first():
    assert {p for p, _ in CANDIDATES} == set(PRESETS)
    for preset in PRESETS:
        layouts = [lay for p, lay in CANDIDATES if p == preset]
        assert len(set(layouts)) == len(layouts) and all(lay.world == WORLD for lay in layouts)
        cfg = load_config(None, job_args(preset, extra=["--parallel.auto=true"]))
        chosen = apply_auto_layout(cfg, WORLD)
        assert chosen == {**chosen, "pp": layouts[0].pp, "tp": layouts[0].tp, "cp": layouts[0].cp,
                          "zero_stage": layouts[0].zero_stage, "micro_batch_size": layouts[0].micro_batch}


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """One single-process run per preset, made on first use."""
    return single_process_runs(tmp_path_factory.mktemp("reference"),
                               lambda out, preset: job_args(preset, out, corpus_cache, extra=[f"--run.name={preset}"]))


@pytest.mark.multirank
@pytest.mark.parametrize("preset, layout", CANDIDATES,
                         ids=[case_id(p, lay) for p, lay in CANDIDATES])
def test_every_layout_the_search_ranks_trains_like_one_process(rank_pool, tmp_path, corpus_cache, references,
                                                               preset, layout):
    single, ref = references(preset)
    args = job_args(preset, tmp_path, corpus_cache, extra=[*layout_args(preset, layout), "--run.name=auto"])
    cfg = validate_config(load_config(None, args), WORLD)
    assert planner_layout(cfg, cfg.parallel.resolved(WORLD))[0] == layout  # the job runs what was ranked
    results = rank_pool.run(trainer_worker, WORLD, args=args, timeout=600.0)
    got = metrics(tmp_path / "auto")
    assert [r["step"] for r in got if r["kind"] == "train"] == [1, 2]
    assert_like_single_process(results, single, ref, got, WORLD)


# ---- tessera plan ---------------------------------------------------------------------------------

PLAN = ["plan", "--model", "llama3-70b", "--gpus", "1024", "--gpu", "h100"]


def test_plan_ranks_only_layouts_the_trainer_accepts_and_prints_their_flags(capsys):
    assert main([*PLAN, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["layouts"]) == 10 and data["fitting"] >= 10
    spec = get_model("llama3-70b")
    for row in data["layouts"]:
        flags = row["train_flags"]
        cfg = load_config(None, flags)
        par = cfg.parallel.resolved(1024)
        validate_composition(cfg, par)  # the pairing rule accepts it ...
        validate_config(cfg, 1024)  # ... and so does every other check of tessera train
        layout, batch, _ = planner_layout(cfg, par)
        assert layout.as_dict() == row["layout"] and batch == 512  # the flags load into that very layout
        assert (cfg.model.dim, cfg.model.n_layers, cfg.model.vocab_size) == (spec.hidden, spec.layers, spec.vocab)
        assert cfg.precision.dtype == "bf16" and cfg.data.seq_len == spec.seq
    # the same layouts, in the same order, as the library's search with the trainer's rule
    rule = TrainerRule(job_flags(spec, 512, spec.seq, "mixed"), 512)
    plan = search(spec, get_gpu("h100"), 1024, 512, rule=rule, top=10)
    assert [e.layout.as_dict() for e in plan.ranked] == [row["layout"] for row in data["layouts"]]


def test_plan_text_prints_the_train_flags_of_each_layout(capsys):
    assert main([*PLAN, "--top", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    common = next(line for line in lines if line.startswith("tessera train "))
    rows = [line.split(None, 1)[1] for line in lines if re.match(r"^\s+#[123]\s+--parallel", line)]
    assert len(rows) == 3 and "top choices:" in out
    for row in rows:  # common flags + the layout's load into a config the trainer accepts
        flags = common.split()[2:] + row.split()
        validate_config(load_config(None, [f for f in flags if f.startswith("--")]), 1024)


def test_refused_layouts_are_not_ranked_and_the_reason_is_the_trainers():
    """A rule that refuses the fastest layouts: the search skips them and keeps their reasons."""
    spec, gpu = get_model("llama2-7b"), get_gpu("a100-80gb")
    free = search(spec, gpu, 16, 32, 2048, top=7)
    banned = {free.ranked[0].layout, free.ranked[3].layout}
    plan = search(spec, gpu, 16, 32, 2048, top=5, rule=lambda lay: "no" if lay in banned else None)
    kept = [e.layout for e in free.ranked if e.layout not in banned]
    assert [e.layout for e in plan.ranked] == kept[:5] and plan.fitting == free.fitting
    assert plan.refused == [(free.ranked[0].layout, "no"), (free.ranked[3].layout, "no")]
    with pytest.raises(NoLayoutFits, match="none of the .* layouts that fit is one tessera train runs; the "
                                           r"fastest \(dp=.*\) is refused: never"):
        search(spec, gpu, 16, 32, 2048, top=5, rule=lambda lay: "never")


def test_the_trainer_rule_follows_the_trainer():
    """TrainerRule builds the config from the printed flags, so it equals validate_config on them."""
    spec = get_model("tessera-tiny")
    flags = job_flags(spec, 8, 32, "fp32")
    assert flags[:1] == ["--model.preset=tiny"]
    rule = TrainerRule(flags, 8)
    plan = search(spec, get_gpu("h100"), 8, 8, 32, precision="fp32")
    for est in plan.ranked[::max(1, len(plan.ranked) // 40)]:  # ~40 spread over the ranking
        layout = est.layout
        full = flags + rule.layout_flags(layout)
        try:
            validate_config(load_config(None, full), layout.world)
            expected = None
        except ConfigError as err:  # the trainer's own sentence
            expected = str(err)
        assert rule(layout) == expected
        if expected is None:  # the flags describe the layout exactly
            cfg = load_config(None, full)
            assert planner_layout(cfg, cfg.parallel.resolved(layout.world))[0] == layout
            assert config_dict(cfg)["parallel"]["auto"] is False
