"""Which strategy pairings cannot be trained together: the one validity rule of the trainer, of
``parallel.auto`` and of ``tessera plan`` (their planner searches rank only layouts the trainer's
``validate_config``, and so this rule, accepts: ``tessera.planner.trainable``).

Every strategy composes with every other (docs/HYBRID.md, tests/test_composition_matrix.py); what is left
here are the pairings that cannot work by construction, each failing before any rank starts with one
sentence that says why and what to change. The rule reads the
*resolved* degrees: ``dp_replicate = -1`` ("whatever the world leaves") is filled in first, so a layout
is judged by what it is, not by how it was written.
"""

from __future__ import annotations

from tessera.errors import ConfigError


def _reject(what: str, fix: str) -> None:
    raise ConfigError(f"{what} cannot be combined; {fix}")


def validate_composition(cfg, parallel) -> None:
    """Reject the pairings that cannot work. ``cfg`` is a JobConfig; ``parallel`` its resolved
    ParallelConfig (concrete degrees: ``dp_replicate = -1`` filled in).

    Trained (docs/HYBRID.md): dp_replicate × dp_shard (ZeRO 0–3) × pp × tp (+SP) × cp × ep with activation
    checkpointing and mixed precision, in any combination, except ZeRO-3 or tied embeddings with the
    weight-stashing schedules (below) and the grid tensor-parallel modes' own limits
    (``tessera.tensor_parallel.nd.validate``)."""
    par = parallel
    if par.pp > 1:
        _validate_pipeline(cfg, par)
    if par.tp > 1 and cfg.tensor_parallel.mode != "1d":  # 2D / 2.5D / 3D: their grid, shapes and pairings
        from tessera.tensor_parallel.nd.validate import validate_nd

        validate_nd(cfg, par)


def _validate_pipeline(cfg, par) -> None:
    """The pairings of pipeline parallelism (``par.pp > 1``)."""
    schedule = cfg.pipeline.schedule
    if par.zero_stage > 2 and schedule in ("pipedream", "2bw"):
        _reject(f"ZeRO-3 with the weight-stashing pipeline.schedule={schedule!r} (every stashed weight "
                "version is a full copy of the stage's parameters, which ZeRO-3 exists not to hold)",
                "use a flush schedule (gpipe, 1f1b, interleaved or zb-h1) or parallel.zero_stage<=2")
    if cfg.model.tie_embeddings and schedule == "pipedream":
        _reject("tied embeddings with the asynchronous pipedream schedule (the first and last stage update "
                "their copies at different times, so the two would drift apart)",
                "set model.tie_embeddings=false or use another pipeline.schedule")
