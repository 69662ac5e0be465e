"""The planner against published GPU training runs: ``tessera plan --validate`` and the uncertainty band.

``published_runs.json`` (beside this file) lists runs as their papers and benchmark pages give them:
model shape, GPU, degrees, batch, sequence, what the code did (``Software``) and the measured throughput
in the publication's unit (TFLOP/s per GPU counted the publication's way, or tokens/s per GPU). Each is
predicted with the planner's own ``estimate`` on that layout — no per-run factor — and the error is
predicted ÷ published − 1. The errors of all runs make the band every estimate carries: a throughput
``x`` is reported with the range ``[x / (1 + largest error), x / (1 + smallest error)]``, the throughputs
the published runs would have had if they erred the way the planner erred on them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tessera.planner.catalog import ModelSpec, get_gpu, get_model
from tessera.planner.estimate import estimate
from tessera.planner.flops import flops_per_iteration, model_flops
from tessera.planner.gpu_kernels import Software
from tessera.planner.layout import Layout

DATA = Path(__file__).with_name("published_runs.json")


@dataclass(frozen=True)
class Check:
    """One published run: what was measured, what the planner predicts, in the publication's unit."""

    name: str
    source: str
    layout: str
    unit: str  # "TFLOP/s/GPU" or "tokens/s/GPU"
    published: float
    predicted: float
    sets_constants: bool

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1.0


def load_runs(path: Path = DATA) -> list[dict]:
    """Every run with its group's fields filled in (a run's own fields win)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return [{**data["groups"][run["group"]], **run,
             "software": {**data["groups"][run["group"]].get("software", {}), **run.get("software", {})}}
            for run in data["runs"]]


def _spec(run: dict) -> ModelSpec:
    model = run["model"]
    if isinstance(model, str):
        return get_model(model, seq=run["seq"])
    h = model["hidden"]
    return ModelSpec(run["name"], model["layers"], h, model["heads"], model["heads"], 4 * h, run["vocab"],
                     run["seq"], arch=run["arch"], tied=True)


def _layout(run: dict) -> Layout:
    tp, pp = run.get("tp", 1), run.get("pp", 1)
    return Layout(dp=run["gpus"] // (tp * pp), zero_stage=run.get("zero_stage", 0), pp=pp, tp=tp,
                  sp=run.get("sp", False), micro_batch=run["micro_batch"], recompute=run["recompute"],
                  schedule=run.get("schedule", "1f1b") if pp > 1 else "none",
                  virtual_stages=run.get("virtual_stages", 1) if pp > 1 else 1)


def check(run: dict) -> Check:
    """Predict one run on its published layout."""
    spec, layout, gpu = _spec(run), _layout(run), get_gpu(run.get("gpu", "a100-80gb"))
    software = Software(compile=run.get("compile", False), **run["software"])
    est = estimate(spec, layout, gpu, run["global_batch"], run["seq"], software=software)
    tokens_per_gpu = est.tokens_per_s / run["gpus"]
    if "measured_tokens_per_s_per_gpu" in run:
        unit, published, predicted = "tokens/s/GPU", run["measured_tokens_per_s_per_gpu"], tokens_per_gpu
    else:
        if run["flops"] == "narayanan-eq3":  # eq. 3 counts full recomputation's extra forward
            per_token = flops_per_iteration(run["global_batch"], run["seq"], spec.layers, spec.hidden, spec.vocab,
                                            recompute=run["recompute"] == "full") / (run["global_batch"] * run["seq"])
        else:
            per_token = model_flops(spec, 1, run["seq"])
        unit, published, predicted = "TFLOP/s/GPU", run["measured_tflops_per_gpu"], tokens_per_gpu * per_token / 1e12
    return Check(run["name"], run["source"], layout.describe() + (" compile" if software.compile else ""), unit,
                 published, predicted, bool(run.get("sets_constants")))


@functools.lru_cache(maxsize=1)
def checks() -> tuple[Check, ...]:
    return tuple(check(run) for run in load_runs())


def band() -> tuple[float, float]:
    """(smallest, largest) throughput error over the published runs."""
    errors = [c.error for c in checks()]
    return min(errors), max(errors)


def step_band(gpu) -> tuple[float, float]:
    """(low, high) multipliers of a predicted step time: the range the real step time falls in if it errs
    as the planner erred on the published runs (a catalogue GPU), or on the held-out shapes of the CPU
    validation (a calibrated local machine)."""
    if gpu.hbm_efficiency:  # a catalogue GPU, timed by the kernel model the published runs check
        low, high = band()
        return 1.0 + low, 1.0 + high
    cpu = json.loads(DATA.read_text(encoding="utf-8"))["calibrated_cpu"]
    return 1.0 / (1.0 + cpu["step_error_max"]), 1.0 / (1.0 + cpu["step_error_min"])


def band_source(gpu) -> str:
    """Where :func:`step_band`'s range for ``gpu`` comes from, as ``tessera plan`` says it."""
    if gpu.hbm_efficiency:
        return "from the planner's errors on published GPU runs (tessera plan --validate)"
    return "from the held-out rows of the CPU validation (docs/PLANNER.md)"


def table() -> str:
    """The published-runs table (markdown), as ``tessera plan --validate`` prints and docs/PLANNER.md holds."""
    head = ("| run | layout (planner) | published | predicted | error | sets a constant |\n"
            "|---|---|---:|---:|---:|:---:|")
    rows = [f"| {c.name} | {c.layout} | {c.published:,.0f} {c.unit} | {c.predicted:,.0f} | {c.error:+.1%} | "
            f"{'yes' if c.sets_constants else ''} |" for c in checks()]
    low, high = band()
    held = [c.error for c in checks() if not c.sets_constants]
    summary = (f"\nlargest |error| {max(abs(c.error) for c in checks()):.1%} over {len(checks())} runs (held out: "
               f"{min(held):+.1%} … {max(held):+.1%}); every estimate on a catalogue GPU carries the band "
               f"step time × {1 + low:.3f} … × {1 + high:.3f}")
    return "\n".join([head, *rows]) + "\n" + summary


def sources() -> list[str]:
    return sorted({run["source"] for run in load_runs()})




BEGIN, END = "<!-- published-runs:begin -->", "<!-- published-runs:end -->"


def write_doc(path: str, text: str) -> None:
    """Replace what lies between the published-runs markers of ``path`` with ``text``."""
    from tessera.errors import ConfigError

    try:
        doc = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror or err}") from None
    if BEGIN not in doc or END not in doc:
        raise ConfigError(f"{path} has no {BEGIN} … {END} markers to write the table between")
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    Path(path).write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}", encoding="utf-8")
