"""Every DeepSpeed config key tessera knows, and what it does with each (``tessera train --deepspeed``).

One row per key path (``"zero_optimization.offload_optimizer.device"``). A key not in this table, at any
nesting level, is refused with one sentence naming it. The actions:

- ``map``: :mod:`tessera.train.deepspeed_json` turns it into ``--section.key=value`` overrides (a map row
  holding a dict is walked into: each of its keys has its own row);
- ``note``: accepted, cannot change results here, reported once on stderr with ``why``;
- ``refuse``: would change results in a way tessera does not do; refused with ``why``.

``quiet`` lists the values at which a note or refuse row is silent: what tessera does anyway (DeepSpeed's
default, mostly). A ``tree`` row covers its section's every sub-key; it is silent when the section says
``"enabled": false``. docs/DEEPSPEED.md prints this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    action: str  # "map", "note" or "refuse"
    why: str = ""
    quiet: tuple = ()
    tree: bool = False


def _map() -> Key:
    return Key("map")


def _note(why: str, quiet: tuple = (), tree: bool = False) -> Key:
    return Key("note", why, quiet, tree)


def _refuse(why: str, quiet: tuple = (), tree: bool = False) -> Key:
    return Key("refuse", why, quiet, tree)


_SAME = "a performance setting: tessera's results do not depend on it"
_ALWAYS = "tessera always does this"
_MONITOR = "a monitoring output of DeepSpeed's; tessera writes metrics.jsonl, summary.json and trace.json"
_ZERO3 = "it applies only to ZeRO-3 (stage 3)"
_OFFLOAD_TUNING = "an offload buffer or pinning setting: the offloaded state and the results are the same"

TOP = {
    "train_batch_size": _map(),
    "train_micro_batch_size_per_gpu": _map(),
    "gradient_accumulation_steps": _map(),
    "gradient_clipping": _map(),
    "steps_per_print": _map(),
    "wall_clock_breakdown": _map(),
    "communication_data_type": _map(),
    "prescale_gradients": _note("dividing the gradients before or after their sum gives the same average; "
                                "tessera reduces them once, in precision.reduce_dtype", quiet=(False,)),
    "gradient_predivide_factor": _note("a pre-division of the gradients before their sum gives the same average "
                                       "(up to rounding)", quiet=(1, 1.0)),
    "gradient_allreduce_op": _refuse("tessera averages the gradients over the data-parallel ranks (token-"
                                     "weighted); a sum would scale the update by the rank count", quiet=("mean",)),
    "sparse_gradients": _refuse("tessera's embedding gradients are dense", quiet=(False,)),
    "disable_allgather": _note(_SAME, quiet=(False,)),
    "zero_allow_untested_optimizer": _note("tessera's ZeRO engines build every optimizer it offers", quiet=(False,)),
    "zero_force_ds_cpu_optimizer": _note("DeepSpeed's CPU Adam is an implementation of the same update",
                                         quiet=(True,)),
    "dump_state": _note(_MONITOR, quiet=(False,)),
    "memory_breakdown": _note(_MONITOR + " (with the memory per rank)", quiet=(False,)),
    "disable_python_gc": _note(_SAME, quiet=(False,)),
    "dataloader_drop_last": _note("tessera's sampler always yields whole global batches", quiet=(False,)),
    "seq_parallel_communication_data_type": _note("applies to DeepSpeed-Ulysses; tessera's context "
                                                  "parallelism communicates in the compute dtype", quiet=("fp32",)),
    "use_data_before_expert_parallelism": _note("a rank-order choice: tessera's rank order is parallel.order",
                                                quiet=(False,)),
    "log_level": _note(_MONITOR),
    "optimizer": _map(),
    "scheduler": _map(),
    "fp16": _map(),
    "bf16": _map(),
    "bfloat16": _map(),
    "zero_optimization": _map(),
    "activation_checkpointing": _map(),
    "tensorboard": _map(),
    "flops_profiler": _note(_MONITOR + " (with MFU per step: run.peak_flops)", tree=True),
    "comms_logger": _note(_MONITOR + " (trace.json holds every collective)", tree=True),
    "wandb": _note(_MONITOR, tree=True),
    "csv_monitor": _note(_MONITOR, tree=True),
    "comet": _note(_MONITOR, tree=True),
    "checkpoint": _note("tessera's checkpoints are layout-independent folders configured by [checkpoint]",
                        tree=True),
    "aio": _note("asynchronous I/O tuning of DeepSpeed's NVMe offload: " + _SAME, tree=True),
    "autotuning": _note("a DeepSpeed launcher feature; tessera's parallel.auto chooses a layout", tree=True),
    "data_types": _refuse("tessera accumulates gradients in the master-weight dtype (fp32) and reduces them in "
                          "precision.reduce_dtype (communication_data_type)", tree=True),
    "amp": _refuse("tessera's mixed precision is fp16 or bf16 (the fp16 / bf16 sections), not Apex AMP", tree=True),
    "torch_autocast": _refuse("tessera casts the model itself (the fp16 / bf16 sections), not by autocast",
                              tree=True),
    "sparse_attention": _refuse("tessera's attention is dense", tree=True),
    "elasticity": _refuse("its batch-size search changes the batch; tessera's elastic restarts keep it "
                          "(run.max_restarts)", tree=True),
    "compression_training": _refuse("quantisation and pruning during training change the model", tree=True),
    "curriculum_learning": _refuse("a curriculum changes the data order and sequence lengths", tree=True),
    "data_efficiency": _refuse("data sampling and routing change the data", tree=True),
    "pipeline": _refuse("tessera's pipeline parallelism is parallel.pp with the [pipeline] section", tree=True),
}

OPTIMIZER = {
    "optimizer.type": _map(),
    "optimizer.params": _map(),
    "optimizer.legacy_fusion": _note(_SAME, quiet=(False,)),
    "optimizer.params.lr": _map(),
    "optimizer.params.betas": _map(),
    "optimizer.params.eps": _map(),
    "optimizer.params.weight_decay": _map(),
    "optimizer.params.adam_w_mode": _map(),
    "optimizer.params.momentum": _map(),
    "optimizer.params.nesterov": _map(),
    "optimizer.params.torch_adam": _note("which Adam implementation runs (torch's or DeepSpeed's fused one): "
                                         "the same update"),
    "optimizer.params.fp32_optimizer_states": _note("tessera keeps optimizer states in fp32", quiet=(True,)),
    "optimizer.params.bias_correction": _refuse("tessera's Adam always corrects the moments' bias", quiet=(True,)),
    "optimizer.params.amsgrad": _refuse("tessera's Adam is not AMSGrad", quiet=(False,)),
    "optimizer.params.foreach": _note("an implementation choice (kernels.adamw): the same update"),
    "optimizer.params.fused": _note("an implementation choice (kernels.adamw): the same update"),
    "optimizer.params.dampening": _refuse("tessera's SGD momentum has no dampening", quiet=(0, 0.0)),
    "optimizer.params.lr_decay": _refuse("tessera's Adagrad has no lr decay (the schedule decays the lr)",
                                         quiet=(0, 0.0)),
    "optimizer.params.initial_accumulator_value": _refuse("tessera's Adagrad starts its sums at 0", quiet=(0, 0.0)),
}

SCHEDULER = {
    "scheduler.type": _map(),
    "scheduler.params": _map(),
    **{f"scheduler.params.{k}": _map() for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                                  "total_num_steps", "warmup_min_ratio", "cos_min_ratio")},
    "scheduler.params.last_batch_iteration": _refuse("a resumed schedule's position comes from the checkpoint "
                                                     "([checkpoint] resume)", quiet=(-1,)),
}

PRECISION = {
    "fp16.enabled": _map(), "fp16.loss_scale": _map(), "fp16.initial_scale_power": _map(),
    "fp16.loss_scale_window": _map(), "fp16.hysteresis": _map(), "fp16.min_loss_scale": _map(),
    "fp16.auto_cast": _note("tessera casts the whole model to fp16 and its inputs are token ids"),
    "fp16.consecutive_hysteresis": _map(),
    "fp16.fp16_master_weights_and_grads": _refuse("tessera always keeps fp32 master weights and gradients",
                                                  quiet=(False,)),
    "bf16.enabled": _map(),  # and every bf16 row under DeepSpeed's older name, bfloat16 (below)
    "bf16.immediate_grad_update": _note(_SAME),
    "bf16.check_grad_overflow": _note("tessera's bf16 has no loss scale, so no step is skipped for overflow; "
                                      "a non-finite gradient norm stops the run"),
    "bf16.bf16_master_weights_and_grads": _refuse("tessera always keeps fp32 master weights and gradients",
                                                  quiet=(False,)),
    "bf16.bf16_optimizer_states": _refuse("tessera keeps optimizer states in fp32", quiet=(False,)),
}
PRECISION.update({"bfloat16." + k[len("bf16."):]: row for k, row in PRECISION.items() if k.startswith("bf16.")})

ZERO = {
    **{f"zero_optimization.{k}": _map() for k in (
        "stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param", "reduce_bucket_size",
        "allgather_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
        "offload_optimizer.device", "offload_optimizer.nvme_path", "offload_param.device",
        "offload_param.nvme_path")},
    "zero_optimization.overlap_comm": _note(_ALWAYS + ": gradient reduction overlaps the backward pass"),
    "zero_optimization.contiguous_gradients": _note(_ALWAYS + ": gradients are reduced from flat buckets"),
    "zero_optimization.allgather_partitions": _note(_ALWAYS + ": parameters are all-gathered (an all-gather "
                                                    "or a broadcast per rank give the same values)"),
    "zero_optimization.reduce_scatter": _note("tessera always reduce-scatters the gradients; an all-reduce "
                                              "gives every rank the same averaged shard", quiet=(True,)),
    "zero_optimization.use_multi_rank_bucket_allreduce": _note(_SAME),
    "zero_optimization.cpu_offload_use_pin_memory": _note(_OFFLOAD_TUNING),
    "zero_optimization.sub_group_size": _note("the optimizer step's granularity: " + _SAME),
    "zero_optimization.round_robin_gradients": _note("gradient placement across ranks: " + _SAME),
    "zero_optimization.elastic_checkpoint": _note("tessera's checkpoints load under any layout"),
    "zero_optimization.load_from_fp32_weights": _note("tessera's checkpoints hold the fp32 master weights",
                                                      quiet=(True,)),
    "zero_optimization.ignore_unused_parameters": _note("tessera's ZeRO handles parameters without gradients",
                                                        quiet=(True,)),
    "zero_optimization.compute_grad_norm": _note("tessera always computes the job-wide gradient norm",
                                                 quiet=(True,)),
    "zero_optimization.memory_efficient_linear": _note(_SAME),
    "zero_optimization.log_trace_cache_warnings": _note(_MONITOR, quiet=(False,)),
    "zero_optimization.legacy_stage1": _refuse("ZeRO-1 is parallel.zero_stage=1", quiet=(False,)),
    "zero_optimization.zero_hpz_partition_size": _note("ZeRO++'s secondary parameter copy: " + _SAME +
                                                       "; a hybrid layout is parallel.dp_replicate × dp_shard",
                                                       quiet=(1,)),
    "zero_optimization.zero_quantized_weights": _refuse("quantised all-gathers change the parameters' values",
                                                        quiet=(False,)),
    "zero_optimization.zero_quantized_nontrainable_weights": _refuse("quantised weights change results",
                                                                     quiet=(False,)),
    "zero_optimization.zero_quantized_gradients": _refuse("quantised gradients change the update", quiet=(False,)),
    **{f"zero_optimization.{k}": _note(why) for k, why in (
        ("stage3_param_persistence_threshold", "which small parameters stay gathered: " + _SAME),
        ("stage3_model_persistence_threshold", "which small parameters stay gathered: " + _SAME),
        ("model_persistence_threshold", "which small parameters stay gathered: " + _SAME),
        ("param_persistence_threshold", "which small parameters stay gathered: " + _SAME),
        ("stage3_max_reuse_distance", "when a gathered parameter is kept for reuse: " + _SAME),
        ("stage3_gather_16bit_weights_on_model_save", "tessera export consolidates any checkpoint"),
        ("stage3_gather_fp16_weights_on_model_save", "tessera export consolidates any checkpoint"),
        ("stage3_module_granularity_threshold", "ZeRO-3 units are zero.wrap_policy's"),
        ("stage3_use_all_reduce_for_fetch_params", _SAME), ("stage3_allgather_sequential", _SAME),
        ("mics_shard_size", "MiCS's sub-group sharding: a hybrid layout is parallel.dp_replicate × dp_shard"),
        ("mics_hierarchical_params_gather", _SAME))},
    **{f"zero_optimization.offload_optimizer.{k}": _note(_OFFLOAD_TUNING) for k in (
        "pin_memory", "buffer_count", "fast_init", "pipeline_read", "pipeline_write", "cpuadam_cores_perc",
        "super_offload")},
    "zero_optimization.offload_optimizer.ratio": _note("a partial offload of the optimizer: the same results",
                                                       quiet=(1, 1.0)),
    **{f"zero_optimization.offload_param.{k}": _note(_OFFLOAD_TUNING) for k in (
        "pin_memory", "buffer_count", "buffer_size", "max_in_cpu")},
}

CHECKPOINTING = {
    "activation_checkpointing.partition_activations": _refuse(
        "tessera does not shard saved activations over tensor-parallel ranks (sequence parallelism, "
        "tensor_parallel.sequence_parallel, shards the activations between blocks)", quiet=(False,)),
    "activation_checkpointing.cpu_checkpointing": _refuse("tessera keeps checkpointed activations on the "
                                                          "device", quiet=(False,)),
    "activation_checkpointing.contiguous_memory_optimization": _note("where checkpoints are allocated: " + _SAME),
    "activation_checkpointing.number_checkpoints": _note("sizes the contiguous buffer: " + _SAME),
    "activation_checkpointing.synchronize_checkpoint_boundary": _note("a device synchronisation: " + _SAME),
    "activation_checkpointing.profile": _note(_MONITOR, quiet=(False,)),
}

TENSORBOARD = {
    "tensorboard.enabled": _map(),
    "tensorboard.output_path": _note("tessera writes TensorBoard files in the run folder's tensorboard/ "
                                     "(run.tensorboard)"),
    "tensorboard.job_name": _note("tessera's run name is run.name"),
}

KEYS: dict[str, Key] = {**TOP, **OPTIMIZER, **SCHEDULER, **PRECISION, **ZERO, **CHECKPOINTING, **TENSORBOARD}
