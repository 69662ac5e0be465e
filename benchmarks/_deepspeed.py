"""DeepSpeed ZeRO as a peer in benchmarks/zero.py: its engine around tessera's own model, configured like
tessera's ZeRO (torch AdamW with the caller's parameter groups, clipping at 1.0, fp32, tessera's bucket
size), and the model-state tensors it holds, counted the way tessera counts its own.

DeepSpeed picks its accelerator when it is first imported, from ``DS_ACCELERATOR``: this module sets it to
"cpu" at import (the rank processes are spawned and inherit the environment, so the parent sets it by
importing this module before any pool starts). DeepSpeed is in the ``bench`` extra, not a dependency.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from typing import Callable, Iterator

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tessera.zero import ZeroConfig  # noqa: E402

# tessera's ZeRO-1/2 gradient bucket (``zero.bucket_mb``, MiB) in fp32 elements, DeepSpeed's unit. DeepSpeed's
# default (5e8 elements) would allocate a 2 GB reduce buffer per rank for a 12 MB model.
BUCKET_ELEMENTS = int(ZeroConfig().bucket_mb * 2**20) // 4


def available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def build_ops() -> None:
    """Compile DeepSpeed's shared-memory collective op (or load it from torch's extension cache) once, in
    the parent, before any rank starts: every rank loads it when its engine is created, and two ranks
    compiling it at the same time made one of them abort."""
    from deepspeed.accelerator import get_accelerator

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load(verbose=False)


def ds_config(stage: int, offload: bool, micro_batch: int, numel: int, persistence: int | None = None) -> dict:
    """ZeRO-``stage`` in fp32 with clipping at 1.0. ``offload`` moves the fp32 partitions and the optimizer
    state to host memory (``offload_optimizer``) and, for stage 3, the parameter partitions too
    (``offload_param``); the optimizer stays the caller's torch AdamW, not DeepSpeedCPUAdam
    (``zero_force_ds_cpu_optimizer: false``), as tessera's ``zero.offload`` and FSDP2's CPU offload do.
    Bucket sizes are tessera's cap, and like tessera's buckets never larger than the model's ``numel``
    parameters (DeepSpeed allocates its reduce bucket at full size). ``persistence`` (stage 3): parameters
    below this many elements stay whole on every rank (``stage3_param_persistence_threshold``; None: its
    default, 1e5; 0: every parameter sharded, as tessera's ZeRO-3 and FSDP2 shard them); every other ZeRO
    setting is DeepSpeed's default."""
    bucket = min(BUCKET_ELEMENTS, numel)
    zero: dict = {"stage": stage, "reduce_bucket_size": bucket}
    if stage < 3:
        zero["allgather_bucket_size"] = bucket
    elif persistence is not None:
        zero["stage3_param_persistence_threshold"] = persistence
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # a client torch optimizer under ZeRO
        "zero_force_ds_cpu_optimizer": False,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def build_engine(model: torch.nn.Module, param_groups: list[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], stage: int, offload: bool,
                 micro_batch: int, persistence: int | None = None):
    """DeepSpeed's engine over the already-initialised default process group; the optimizer is
    ``make_optimizer(param_groups)`` (DeepSpeed swaps each group's parameters for its fp32 partitions and
    keeps the group's arguments, weight decay included)."""
    import deepspeed
    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # its collectives call torch APIs that warn on every call; the warnings are about DeepSpeed, not the run
    warnings.filterwarnings("ignore", message="`torch.distributed.[a-z_]+` is deprecated", category=FutureWarning)
    # DeepSpeed reads its launcher's contract from the environment even when the group already exists;
    # the ranks here are local processes of one machine, so local rank = rank.
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    numel = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(param_groups),
                                      config=ds_config(stage, offload, micro_batch, numel, persistence))
    return engine


def held_tensors(engine) -> Iterator[torch.Tensor]:
    """Every tensor of model state the engine holds: the module's parameters and gradients (ZeRO-3: each
    parameter's local partition ``p.ds_tensor`` and its gradient), every tensor the ZeRO optimizer keeps in
    its attributes (flat parameter groups, fp32 partitions, gradient buckets and partitions, offload
    buffers), and the inner torch optimizer's state. Views of one storage count once downstream."""
    for p in engine.module.parameters():
        part = getattr(p, "ds_tensor", None)
        yield from (p.data, p.grad, part, getattr(part, "grad", None))
    zero = engine.optimizer
    yield from _walk(zero, set(), depth=0)
    inner = getattr(zero, "optimizer", zero)
    for state in inner.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _walk(obj, seen: set, depth: int) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through lists, tuples, dicts and DeepSpeed objects' attributes (not
    into torch modules, optimizers or process groups: those are counted above or hold no model state)."""
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.is_leaf and obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, (list, tuple, set)):
        for item in obj:
            yield from _walk(item, seen, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _walk(item, seen, depth + 1)
    elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            yield from _walk(item, seen, depth + 1)
