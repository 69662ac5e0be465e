"""The planner on this machine: a GpuSpec for local CPU ranks and the layout ``--parallel.auto`` picks."""

from __future__ import annotations

from tessera.errors import ConfigError
from tessera.planner.catalog import GpuSpec, from_model_config
from tessera.planner.search import SearchSpace, search
from tessera.planner.trainable import parallel_degrees

# Orientation values for a small CPU box (a 100 MB gloo all-reduce on 2 ranks took 60–100 ms on the
# 2-core machines this project is tested on); `tessera plan --calibrate` measures the real ones.
DEFAULT_LOCAL = {"peak_flops": 5e10, "alpha_s": 1e-4, "bytes_per_s": 1.5e9, "hbm_bytes_per_s": 1e10}


def local_gpu(world_size: int, calibration: dict | None = None, memory_bytes: float = 8 * 2**30) -> GpuSpec:
    """Local ranks as one 'node': measured (or default) matmul rate and gloo α, β; every rank a GPU."""
    c = {**DEFAULT_LOCAL, **(calibration or {})}
    # a training step's rate, not a big matmul's; measured with every rank busy, or alone for one rank
    step = c.get("step_flops_alone" if world_size == 1 else "step_flops", c.get("step_flops"))
    elementwise = c.get("elementwise_s_per_byte", 0.0)
    if elementwise and c.get("step_flops_alone"):  # matmuls and non-matmul kernels charged apart: the
        # efficiency is only how much ranks running at once slow each other down
        efficiency = min(1.0, step / c["step_flops_alone"])
    else:  # older calibrations: everything that is not a matmul folded into one efficiency
        efficiency = min(1.0, step / c["peak_flops"]) if step else 1.0
    cores, measured = c.get("cores"), c.get("ranks")
    if cores and measured and world_size > 1:  # ranks share the cores: more ranks than cores run slower
        efficiency *= min(1.0, cores / world_size) / min(1.0, cores / measured)
    hbm = c["hbm_bytes_per_s"]
    # gloo's collectives run on the same cores as the compute, so nothing overlaps; "offloading" to host
    # memory on a CPU is the same memory: an update as costly as on the device, plus two copies
    return GpuSpec("local-cpu", peak_flops=c["peak_flops"], memory_bytes=memory_bytes,
                   hbm_bytes_per_s=hbm, host_bytes_per_s=hbm, host_adam_params_per_s=hbm / 32, overlap=0.0,
                   intra_bytes_per_s=c["bytes_per_s"],
                   inter_bytes_per_s=c["bytes_per_s"], gpus_per_node=max(1, world_size),
                   intra_alpha_s=c["alpha_s"], inter_alpha_s=c["alpha_s"], compute_efficiency=efficiency,
                   usable_fraction=1.0, elementwise_s_per_byte=elementwise,
                   collective_sync_s=c.get("collective_sync_s", 0.0), layer_call_s=c.get("layer_call_s", 0.0),
                   attention_flops=c.get("attention_rate", 0.0),
                   attention_row_s=c.get("attention_row_s", 0.0), ring_forward_s=c.get("ring_forward_s", 0.0),
                   ring_backward_s=c.get("ring_backward_s", 0.0), half_flops=c.get("half_flops", 0.0))


def rank_local_layouts(model_cfg, world_size: int, global_batch: int, seq: int, *,
                       micro_batch: int | None = None, calibration: dict | None = None,
                       memory_bytes: float = 8 * 2**30, precision: str = "fp32",
                       strategies: tuple = ("dp", "zero", "tp", "sp", "pp"), rule=None, top: int | None = None):
    """Every layout of a tessera ``ModelConfig`` on ``world_size`` local ranks that fits (and that
    ``rule(layout) -> reason | None``, the trainer's validity rule, accepts), fastest first: a list of
    Estimates. ``strategies`` limits the search. Raises ConfigError when no layout divides the batch and
    NoLayoutFits when none fits or the rule accepts none."""
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    spec = from_model_config("local", model_cfg)
    space = SearchSpace(tp="tp" in strategies, sp="sp" in strategies, pp="pp" in strategies,
                        cp="cp" in strategies, zero_stages=(0, 1, 2, 3) if "zero" in strategies else (0,),
                        recompute=("none",), offload=False,
                        micro_batches=(micro_batch,) if micro_batch else (1, 2, 4, 8))
    gpu = local_gpu(world_size, calibration, memory_bytes)
    return search(spec, gpu, world_size, global_batch, seq, precision=precision, optimizer="adam",
                  space=space, top=top, rule=rule).ranked


def choose_local_layout(model_cfg, world_size: int, global_batch: int, seq: int, **kwargs) -> dict:
    """The fastest layout of :func:`rank_local_layouts` (same arguments), as degrees: a dict with the
    ParallelConfig degrees (dp_replicate, dp_shard, pp, tp, cp, ep: ZeRO layouts put dp on dp_shard),
    zero_stage, sequence_parallel, schedule, micro_batch_size, recompute and the predicted step_time_s."""
    best = rank_local_layouts(model_cfg, world_size, global_batch, seq, top=1, **kwargs)[0]
    return as_degrees(best.layout, best.step_time_s)


def as_degrees(layout, step_time_s: float | None = None) -> dict:
    """``layout`` as the degrees dict of :func:`choose_local_layout`."""
    return {**parallel_degrees(layout), "sequence_parallel": layout.sp, "schedule": layout.schedule,
            "micro_batch_size": layout.micro_batch, "recompute": layout.recompute, "step_time_s": step_time_s}
