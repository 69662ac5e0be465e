"""Which data-parallel modes exist (``ddp.mode`` × ``ddp.consistency``), how each is built, and what each
cannot compose with (refused before launch, one sentence saying why).

Registry: :data:`MODES` maps (mode, consistency) to a builder ``build(parts: ModeParts) -> mode`` (the
contract of a mode: ``tessera.train.dp_modes.base``). A new mode registers with one line, e.g.
``MODES["ps-sharded", "ssp"] = build_ssp``; :func:`validate_modes` refuses a pair nobody registered.
The builders import their mode's module only when a job uses it.
"""

from __future__ import annotations

import math
from typing import Callable

from tessera.device import computes_on_cpu
from tessera.errors import ConfigError
from tessera.train.dp_modes.base import DataParallelMode, ModeParts

PS_MODES = ("ps-rank0", "ps-sharded")
SINGLE_PROCESS_MODES = ("dataparallel", "central-storage")

# (ddp.mode, ddp.consistency) -> builder; filled at the bottom of this file and by later modes
MODES: dict[tuple[str, str], Callable[[ModeParts], DataParallelMode]] = {}


def build_mode(parts: ModeParts) -> DataParallelMode:
    key = (parts.ddp.mode, parts.ddp.consistency)
    if key not in MODES:  # validate_modes refused it before launch; a library caller gets the same sentence
        raise ConfigError(f"ddp.mode={key[0]!r} has no ddp.consistency={key[1]!r} variant")
    return MODES[key](parts)


def validate_modes(cfg, parallel) -> None:
    """Refuse, with one sentence saying why, a ``ddp.mode`` that cannot run in this job (``parallel``:
    the resolved ParallelConfig; called from ``tessera.train.config.validate_strategies``)."""
    d = cfg.ddp.validate()  # names and ranges (DDPConfig.validate)
    if d.mode == "allreduce":
        return
    if (d.mode, d.consistency) not in MODES:
        raise ConfigError(f"ddp.consistency={d.consistency!r} applies to the parameter-server modes "
                          f"(ps-rank0, ps-sharded), not to ddp.mode={d.mode!r}" if d.mode not in PS_MODES else
                          f"ddp.mode={d.mode!r} has no ddp.consistency={d.consistency!r} variant")
    replicas = parallel.dp_replicate * parallel.dp_shard
    why = _refusal(cfg, parallel, replicas)
    if why:
        raise ConfigError(f"ddp.mode={d.mode!r} cannot run here: {why}")
    if d.consistency != "sync":  # the asynchronous servers' own limits (tp/cp slices, precision, offload)
        from tessera.train.dp_modes.ps_async import validate_async

        validate_async(cfg, parallel)
    builder = MODES[d.mode, d.consistency]
    if d.mode == "ps-rank0" and cfg.precision.below_fp32:  # the server's fp32 masters are no model piece
        builder = _ps_rank0_mixed
    if not getattr(builder, "checkpointable", True) and (cfg.checkpoint.every or cfg.checkpoint.resume):
        why = getattr(builder, "checkpoint_refusal", "its state is not that of one process")
        raise ConfigError(f"ddp.mode={d.mode!r} (ddp.consistency={d.consistency!r}) {why}, which a checkpoint (the "
                          f"parameters and optimizer state of one process) cannot hold; remove checkpoint.every "
                          f"and checkpoint.resume")


def _refusal(cfg, parallel, replicas: int) -> str:
    """Why ``cfg.ddp.mode`` (not "allreduce") cannot compose with this job, or ""."""
    mode, single = cfg.ddp.mode, cfg.ddp.mode in SINGLE_PROCESS_MODES
    if parallel.zero_stage > 0:
        return ("ZeRO (parallel.zero_stage > 0) shards the optimizer over the very data-parallel ranks this mode "
                "keeps apart or centralises (ps-sharded is ZeRO-1 with the exchange at the step); set "
                "parallel.zero_stage=0")
    if parallel.ep > 1:
        return ("expert parallelism is carved out of the data-parallel ranks, so they hold different experts and "
                "are not replicas; set parallel.ep=1")
    if parallel.pp > 1 and cfg.pipeline.schedule == "pipedream" and not single:
        return ("pipeline.schedule='pipedream' updates each stage inside its schedule after every micro-batch, "
                "with gradients reduced per micro-batch, while this mode exchanges once per optimizer step; "
                "use another schedule (e.g. '2bw')")
    if single and math.prod(parallel.degrees().values()) != 1:
        return "one process drives every device of ddp.devices; run it as one rank (run.nproc=1)"
    if single and not cfg.ddp.devices and computes_on_cpu(cfg.run.device):
        return 'on a CPU it needs the devices to drive, e.g. ddp.devices=["cpu", "cpu"]'
    if not single and replicas * parallel.cp == 1:
        return "it combines data-parallel replicas, and this job has one (raise parallel.dp_replicate)"
    return ""


def _local_sgd(parts: ModeParts) -> DataParallelMode:
    from tessera.train.dp_modes.local_sgd import LocalSGDMode

    return LocalSGDMode(parts)


def _single_process(parts: ModeParts) -> DataParallelMode:
    from tessera.train.dp_modes.single_process import SingleProcessMode

    return SingleProcessMode(parts)


def _ps(parts: ModeParts) -> DataParallelMode:
    from tessera.train.dp_modes.ps_sync import build_server_mode

    return build_server_mode(parts)


def _ps_rank0_mixed(parts: ModeParts) -> DataParallelMode:
    return _ps(parts)  # the same builder; its checkpoint attributes are those of bf16 / fp16 parameters


# validate_modes reads these from the builder: False refuses checkpoint.every / resume, saying why
_local_sgd.checkpointable = False
_local_sgd.checkpoint_refusal = "keeps one optimizer state per replica"
_ps_rank0_mixed.checkpointable = False
_ps_rank0_mixed.checkpoint_refusal = "keeps the served fp32 masters beside the bf16/fp16 parameters on its server"
MODES.update({("local-sgd", "sync"): _local_sgd, ("ps-rank0", "sync"): _ps, ("ps-sharded", "sync"): _ps,
              ("dataparallel", "sync"): _single_process, ("central-storage", "sync"): _single_process})


def _async_ps(parts: ModeParts) -> DataParallelMode:
    from tessera.train.dp_modes.ps_async import build_async_mode

    return build_async_mode(parts)


_async_ps.checkpointable = False  # the servers' state lives in threads of several ranks
MODES.update({(m, c): _async_ps for m in PS_MODES for c in ("ssp", "async")})  # dp_modes.ps_async
