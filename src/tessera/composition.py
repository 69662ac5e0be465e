"""Which strategy pairings this version can train: the one validity rule of the trainer and of
``parallel.auto`` (whose planner search accepts only layouts that pass it). ``tessera plan``'s search over
catalogue GPUs does not consult it yet, so it may recommend a layout the trainer refuses.

A pairing that cannot be composed fails here, before any rank starts, with one sentence that says why and
what to change (docs/HYBRID.md lists every supported and refused combination). The rule reads the
*resolved* degrees: ``dp_replicate = -1`` ("whatever the world leaves") is filled in first, so a layout
is judged by what it is, not by how it was written.
"""

from __future__ import annotations

from tessera.errors import ConfigError


def _reject(what: str, fix: str) -> None:
    raise ConfigError(f"{what} is not supported in this version of tessera; {fix}")


def validate_composition(cfg, parallel) -> None:
    """Reject strategy pairings this version cannot train. ``cfg`` is a JobConfig; ``parallel`` its
    resolved ParallelConfig (concrete degrees: ``dp_replicate = -1`` filled in).

    Supported (docs/HYBRID.md): dp_replicate × dp_shard (ZeRO 0–3) × tp (+SP) × cp, pp × dp × tp (+SP)
    with ZeRO 0–1, ep × dp × tp (+SP) with DDP or ZeRO-1/2, mixed precision × dp × tp."""
    par = parallel
    mixed = cfg.precision.below_fp32
    if par.pp > 1:
        _validate_pipeline(cfg, par, mixed)
    if par.ep > 1 and par.cp > 1:
        _reject("expert parallelism together with context parallelism (routing groups would be sequence "
                "chunks)", "set parallel.cp=1")
    if par.ep > 1 and par.zero_stage > 2:
        _reject("expert parallelism together with ZeRO-3 (expert units would gather over edp, not dp)",
                "use parallel.zero_stage=0, 1 or 2")
    if par.ep > 1 and par.zero_stage > 0 and par.dp_shard > 1 and par.dp_replicate > 1:
        _reject(f"expert parallelism together with hybrid sharding (dp_replicate={par.dp_replicate} × "
                f"dp_shard={par.dp_shard}: dense state shards over the whole dp)",
                "set parallel.dp_shard=1 or parallel.dp_replicate=1")
    if (par.cp > 1 or par.ep > 1) and mixed:
        _reject("mixed precision together with context or expert parallelism", "use precision.dtype=fp32")
    if cfg.model.num_experts and par.cp > 1:
        _reject("context parallelism of a mixture-of-experts model (routing groups would be sequence "
                "chunks)", "set parallel.cp=1")
    if par.tp > 1 and cfg.tensor_parallel.mode != "1d":
        _reject(f"training with tensor_parallel.mode={cfg.tensor_parallel.mode!r} (those layers are a library)",
                "use tensor_parallel.mode=1d")


def _validate_pipeline(cfg, par, mixed: bool) -> None:
    """The pairings of pipeline parallelism (``par.pp > 1``)."""
    schedule = cfg.pipeline.schedule
    if cfg.model.num_experts:
        _reject("pipeline parallelism of a mixture-of-experts model", "set parallel.pp=1")
    for axis in ("cp", "ep"):
        if getattr(par, axis) > 1:
            _reject(f"pipeline parallelism together with parallel.{axis}>1 (stages exchange whole "
                    f"sequences)", f"set parallel.{axis}=1")
    if par.zero_stage > 1:
        _reject("pipeline parallelism together with ZeRO-2/3 (they reduce or gather on every backward, "
                "the pipeline runs many)", "use parallel.zero_stage=0 or 1")
    if mixed or cfg.checkpointing.mode != "none":
        _reject("pipeline parallelism together with mixed precision or [checkpointing]",
                "use precision.dtype=fp32 and checkpointing.mode=none "
                "(pipeline.recompute re-materialises stages)")
    if par.tp > 1 and schedule in ("pipedream", "2bw"):
        _reject(f"tensor parallelism with the weight-stashing pipeline.schedule={schedule!r}",
                "use a flush schedule (gpipe, 1f1b, interleaved or zb-h1)")
    if par.zero_stage == 1 and schedule == "pipedream":
        _reject("ZeRO-1 with the asynchronous pipedream schedule (it steps inside the pipeline)",
                "use another pipeline.schedule or parallel.zero_stage=0")
    if cfg.model.tie_embeddings and schedule == "pipedream":
        _reject("tied embeddings with the asynchronous pipedream schedule (the first and last stage update "
                "their copies at different times, so the two would drift apart)",
                "set model.tie_embeddings=false or use another pipeline.schedule")
