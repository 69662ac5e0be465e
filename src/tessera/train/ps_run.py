"""What ``tessera train --model.preset=ctr --ps.*`` runs: a parameter-server job in a fresh run folder.

The job starts its own server and worker processes (it is not a set of collective ranks): the CLI
refuses it under torchrun, and checks where it will listen, before this runs. The run folder gets
``config.toml``, ``metrics.jsonl`` (worker 0's loss per step), ``summary.json`` (AUC, its ceiling,
staleness histograms, bytes, examples/s) and ``tables/``.
It lives in the training layer, beside the run folders and configs it uses; the parameter server
itself (``tessera.parameter_server``) knows neither.
"""

from __future__ import annotations

from pathlib import Path

from tessera.parameter_server.job import run_ps_job
from tessera.train.config import save_config
from tessera.train.rundir import first_free


def train_ctr(cfg, interface: tuple[str, str] | None = None) -> dict:
    """``cfg`` is the validated job config (tessera.train.config.JobConfig): uses ``ps``, ``train.steps``
    and ``run``. ``interface``: where the RPC listens, as the CLI's pre-flight found it (see ``run_ps_job``)."""
    ps = cfg.ps
    name = cfg.run.name or f"ctr-ps{ps.servers}-w{ps.workers}-{ps.mode}"
    run_dir = first_free(Path(cfg.run.out_dir) / name)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.toml")
    last = [-1]

    def progress(step: int) -> None:
        if cfg.run.progress and (step + 1) % max(cfg.train.log_every, 1) == 0 and step > last[0]:
            last[0] = step
            print(f"step {step + 1}/{cfg.train.steps}", flush=True)

    summary = run_ps_job(ps, cfg.train.steps, seed=cfg.run.seed, out_dir=str(run_dir), progress=progress,
                         interface=interface)
    return {"run_dir": str(run_dir), "mode": ps.mode, "servers": ps.servers, "workers": ps.workers,
            "steps": cfg.train.steps, "auc": round(summary["auc"], 4),
            "ceiling_auc": round(summary["ceiling_auc"], 4), "max_gap": summary["max_gap"],
            "examples_per_s": round(summary["examples_per_s"], 1), "seconds": round(summary["seconds"], 2)}
