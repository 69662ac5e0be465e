"""Memory per rank and time per step of one model, layout and GPU: the planner's core evaluation.

Memory is that of the busiest pipeline stage (the first holds the embedding and the most micro-batches
in flight, the last the output layer and logits). Time: the stage's compute (at peak × efficiency) and
its tensor-, context- and expert-parallel collectives, stretched by the pipeline bubble, plus the
pipeline's point-to-point sends on the critical path, the exposed part of the data-parallel gradient
synchronisation, and the optimizer update.

LoRA (``spec.lora_rank`` > 0): the adapters are the trainable parameters (gradients, optimizer states,
the data-parallel reduction and the update follow them alone); the base weights are frozen, held in the
training dtype and sharded by ZeRO-3 only (which still gathers them for forward and backward); the
backward still computes input gradients through them (``tessera.planner.flops.model_flops``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessera.planner import comm_model as cm
from tessera.planner.cpu_compute import calibrated_compute_s
from tessera.planner.flops import bubble_fraction, model_flops, recompute_flops
from tessera.planner.gpu_kernels import TESSERA, Software, stage_time, zero3_exposed
from tessera.planner.memory import (DISK_STAGING_BYTES, ELEM_BYTES, embedding_bytes, layer_activation_bytes,
                                    logits_bytes, model_state_bytes, offload_kind, stage_inflight)

BUCKET_BYTES = 25 * 2**20  # data-parallel gradient buckets (DDP, ZeRO-1/2) of tessera and PyTorch


@dataclass
class Estimate:
    layout: object
    memory_bytes: dict  # params, grads, optimizer, activations, buffers, total (device, busiest stage)
    host_bytes: float  # optimizer states moved to host memory by offload
    time_s: dict  # compute, tp, cp, ep, bubble, pp_p2p, dp_exposed, optimizer, offload
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float
    fits: bool
    notes: list = field(default_factory=list)


def _stage_params(spec, layout, first: bool, last: bool) -> tuple[float, float]:
    """(dense, expert) parameters one rank of a stage holds: tp splits the matrices (the experts too, as
    the planner approximates), the norms' weights are whole on every tp rank."""
    per_stage = spec.layers / layout.pp
    norms = spec.norm_params()
    dense = per_stage * ((spec.dense_layer_params() - norms) / layout.tp + norms)
    if first:
        dense += spec.embedding_params() / layout.tp
    if last:
        norm = spec.final_norm_params()
        head = spec.head_params() - norm + (spec.vocab * spec.hidden if spec.tied and layout.pp > 1 else 0)
        dense += head / layout.tp + norm
    expert = per_stage * spec.expert_layer_params() / (layout.ep * layout.tp)
    return dense, expert


def _stage_split(spec, layout, first: bool, last: bool) -> tuple[tuple[float, float], tuple[float, float]]:
    """((trainable, frozen) dense, (trainable, frozen) expert) parameters one rank of a stage holds: all
    of them trainable, or with LoRA the adapters (split over tp as their layers, experts' over ep) and
    the base weights frozen."""
    dense, expert = _stage_params(spec, layout, first, last)
    if not spec.lora_rank:
        return (dense, 0.0), (expert, 0.0)
    per_stage = spec.layers / layout.pp
    a_dense, a_expert = spec.adapter_layer_params(layout.tp)
    return (per_stage * a_dense, dense), (per_stage * a_expert / layout.ep, expert)


def _model_states(n: tuple[float, float], layout, shard: int, precision: str, optimizer: str) -> dict:
    """ZeRO's model-state bytes of ``n`` = (trainable, frozen) parameters sharded over ``shard`` ranks.
    Frozen ones (LoRA's base weights) are held in the training dtype alone, whole unless ZeRO-3 shards
    them, with no gradient, master or optimizer state. Under a pipeline the gradients accumulate whole
    over the step's micro-batches and are reduce-scattered once after the last one
    (``tessera.train.pipeline_step``), so ZeRO-2/3 hold full gradients during the step, as ZeRO-1."""
    trainable, frozen = n
    states = model_state_bytes(trainable, zero_stage=layout.zero_stage, dp=shard, precision=precision,
                               optimizer=optimizer, zero1_reduced=layout.pp == 1)
    if layout.pp > 1 and layout.zero_stage >= 2:
        states["grads"] = model_state_bytes(trainable, zero_stage=1, dp=shard, precision=precision,
                                            optimizer=optimizer)["grads"]
    states["params"] += ELEM_BYTES[precision] * frozen / (shard if layout.zero_stage >= 3 else 1)
    states["total"] = states["params"] + states["grads"] + states["optimizer"]
    return states


def stage_memory(spec, layout, global_batch: int, seq: int, precision: str, optimizer: str,
                 stage: int) -> tuple[dict, float]:
    """(device bytes by kind, host bytes) for one rank of pipeline stage ``stage`` (0 … pp−1). Ranks of
    one stage hold equal shares (tp, ep and ZeRO split evenly), so this is every rank of the stage. The
    first stage also holds the embedding, the last the output layer and the logits. Offload (``layout.
    offload``: True or "host", or "disk") takes the optimizer states off the device: to host memory
    (``host``), or to files on disk, keeping only :data:`DISK_STAGING_BYTES` of buffers in host memory."""
    first, last = stage == 0, stage == layout.pp - 1
    elem = ELEM_BYTES[precision]
    shard = layout.dp * layout.cp  # cp ranks hold the same weights, so ZeRO shards over dp × cp
    dense, expert = _stage_split(spec, layout, first, last)
    states = _model_states(dense, layout, shard, precision, optimizer)
    if sum(expert):
        ex = _model_states(expert, layout, max(1, shard // layout.ep), precision, optimizer)
        states = {k: states[k] + ex[k] for k in states}
    trainable = dense[0] + expert[0]
    # mixed precision: the update reads an fp32 copy of this rank's reduced gradient slice (next to the
    # masters, so on the host with host offload)
    update_grads = 4 * trainable / (shard if layout.zero_stage else 1) if precision == "mixed" else 0.0
    host, offload = 0.0, offload_kind(layout.offload)
    if offload != "none":  # the host runs the update: optimizer states there, and in fp32 training (no
        # master copy among the optimizer states) an fp32 copy of the parameter shard to update
        master = 4 * trainable / shard if precision == "fp32" else 0.0
        moved, states["optimizer"] = states["optimizer"] + master, 0.0
        host = moved + update_grads if offload == "host" else DISK_STAGING_BYTES
        update_grads = 0.0 if offload == "host" else update_grads
    seq_local = seq // layout.cp
    inflight = stage_inflight(stage, layout.schedule, layout.pp, layout.microbatches(global_batch),
                              layout.virtual_stages)
    acts = layer_activation_bytes(spec, layout, seq_local, elem) * spec.layers / layout.pp * inflight
    if first:
        acts += inflight * embedding_bytes(seq_local, layout.micro_batch, spec.hidden, tp=layout.tp,
                                           sequence_parallel=layout.sp, dropout=spec.arch == "gpt")
    if last:  # the loss's saved logits, for every micro-batch whose backward has not run (ZB-H1's input-
        # gradient half frees them as 1F1B's backward does: its held-back W's need the linears' tensors only)
        logits_inflight = inflight if layout.schedule != "zb-h1" else stage_inflight(
            stage, "1f1b", layout.pp, layout.microbatches(global_batch))
        acts += logits_inflight * logits_bytes(seq_local, layout.micro_batch, spec.hidden, spec.vocab, tp=layout.tp,
                                        elem_bytes=elem)
    buffers = update_grads + _zero3_buffers(spec, layout, shard, elem)
    if layout.pp > 1:  # one activation to send and one received, per direction
        buffers += 4 * layout.micro_batch * seq_local * spec.hidden * elem / (layout.tp if layout.sp else 1)
    mem = {"params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"],
           "activations": acts, "buffers": buffers}
    mem["total"] = sum(mem.values())
    return mem, host


def _zero3_buffers(spec, layout, shard: int, elem: int) -> float:
    """ZeRO-3's whole units in the compute dtype beside the shards. Units are tessera's block policy's:
    each layer, the embedding and the output head (``unit`` elements: the largest). In backward, without
    a pipeline: the unit computing and the one prefetched, the gradient [unit] accumulating and the one
    before it still being reduce-scattered. Under a pipeline (manual mode, no prefetch) a unit is gathered
    for its use (the full gradients of the stage are counted among the model states). LoRA: a unit's
    gradient is its adapters' (a layer's; the embedding and head have none)."""
    if layout.zero_stage != 3 or shard == 1:
        return 0.0
    layer = spec.dense_layer_params() / layout.tp + spec.expert_layer_params() / (layout.ep * layout.tp)
    unit = max(layer, spec.embedding_params() / layout.tp, spec.head_params() / layout.tp)
    if layout.pp > 1:
        return 2 * unit * elem
    grad_unit = unit
    if spec.lora_rank:
        a_dense, a_expert = spec.adapter_layer_params(layout.tp)
        grad_unit = a_dense + a_expert / layout.ep
    return 2 * (unit + grad_unit) * elem


def memory_per_rank(spec, layout, global_batch: int, seq: int, precision: str = "mixed",
                    optimizer: str = "adam") -> tuple[dict, float]:
    """Device bytes of the busiest stage's rank, and its host bytes."""
    stages = {0, layout.pp - 1}  # a middle stage holds no more: fewer micro-batches, no embedding or head
    return max((stage_memory(spec, layout, global_batch, seq, precision, optimizer, s) for s in sorted(stages)),
               key=lambda pair: pair[0]["total"])


def step_time(spec, layout, gpu, global_batch: int, seq: int, precision: str = "mixed",
              optimizer: str = "adam", software: Software = TESSERA) -> tuple[dict, float]:
    """(seconds by part, total seconds) of one optimizer step.

    Compute: matmul FLOPs at peak × efficiency (attention's score and value matmuls at ``attention_flops``
    plus ``attention_row_s`` per token, head and layer where calibrated; ring attention by the scores each
    rank computes, where ``ring_forward_s`` is calibrated), plus the non-matmul kernels at
    ``elementwise_s_per_byte`` per byte of activations saved and ``layer_call_s`` per layer and
    micro-batch (both 0 for catalogue GPUs, where the efficiency covers them; calibrated on CPU, where
    norms, SwiGLU, softmax and residual adds take a third of a step, a TP rank still runs the replicated
    ones in full, and every rank pays each kernel's dispatch however few tokens or how narrow a slice it
    computes). Every blocking collective on the critical path costs its α–β time plus
    ``collective_sync_s`` (the exposed start-up of a collective issued between compute segments). A catalogue
    GPU with a kernel model (``gpu.hbm_efficiency`` > 0) times the busiest stage's compute kernel by kind
    instead (``tessera.planner.gpu_kernels``; ``software`` says what the training code does: tessera's by
    default)."""
    elem = ELEM_BYTES[precision]
    links = cm.axis_links(gpu, layout)
    sync = gpu.collective_sync_s
    m = layout.microbatches(global_batch)
    seq_local = seq // layout.cp
    layers_here = spec.layers / layout.pp
    if gpu.hbm_efficiency:  # GPU kernel model; the busiest stage is the last (it holds the output layer and loss)
        compute = m * stage_time(spec, layout, gpu, seq, elem, software).total
    else:
        compute = calibrated_compute_s(spec, layout, gpu, global_batch, seq, precision)
    act_bytes = layout.micro_batch * seq_local * spec.hidden * elem
    tp = _tensor_parallel_s(layout, links["tp"], sync, m, layers_here, seq_local, act_bytes)
    if layout.tp > 1:  # LoRA: each backward all-reduces the gradient of each adapter factor tp keeps whole
        tp += m * layers_here * sum(s * (cm.all_reduce_s(n * elem, layout.tp, links["tp"]) + sync)
                                    for s, n in spec.replicated_adapter_factors())
    # context parallel: keys and values gathered forward, gathered again and reduce-scattered backward
    # (ring attention: 3cp − 2 blocking shifts per layer)
    kv_bytes = 2 * layout.micro_batch * seq * spec.head_dim * spec.kv_heads / layout.tp * elem
    cp = layers_here * m * 3 * cm.all_gather_s(kv_bytes, layout.cp, links["cp"])
    if layout.cp > 1:
        cp += layers_here * m * (3 * layout.cp - 2) * sync
    # expert parallel: per MoE layer the count exchange, dispatch and combine all-to-all forward and backward
    ep = 0.0
    if spec.experts > 1 and layout.ep > 1:
        moe_layers = layers_here * spec.moe_fraction
        ep = moe_layers * m * (4 * cm.all_to_all_s(act_bytes * spec.top_k, layout.ep, links["ep"]) + 5 * sync)
    bubble = bubble_fraction(layout.schedule, layout.pp, m, layout.virtual_stages) if layout.pp > 1 else 0.0
    stage = compute + tp + cp + ep
    pipeline = stage / (1.0 - bubble)
    p2p = 0.0
    if layout.pp > 1:
        sent = act_bytes / (layout.tp if layout.sp or software.p2p_scatter_gather else 1)
        p2p = 2 * (m + layout.pp - 1) * layout.virtual_stages * (cm.p2p_s(sent, links["pp"]) + sync)
    hidden = compute if software.dp_overlap else 0.0  # what the data-parallel reduction can hide behind
    dp_exposed, optim, offload = _data_parallel_and_update(spec, layout, gpu, links["dp"], hidden, m, elem,
                                                           precision, optimizer)
    parts = {"compute": compute, "tp": tp, "cp": cp, "ep": ep, "bubble": pipeline - stage, "pp_p2p": p2p,
             "dp_exposed": dp_exposed, "optimizer": optim, "offload": offload}
    return parts, pipeline + p2p + dp_exposed + optim + offload


def _tensor_parallel_s(layout, link, sync: float, m: int, layers_here: float, seq_local: int,
                       act_bytes: float) -> float:
    """Tensor-parallel collectives of one step, all on the critical path: 2 all-reduces forward, 2
    backward per layer (as AG + RS with SP: same bytes); 2 more when full recomputation re-runs the
    forward; around the layers, the embedding's forward and the head's backward all-reduce and the
    loss's 3 per-token reductions."""
    if layout.tp == 1:
        return 0.0
    calls = 4 + (2 if layout.recompute == "full" else 0)
    loss = 3 * (cm.all_reduce_s(layout.micro_batch * seq_local * 4, layout.tp, link) + sync)
    if layout.sp:  # each all-reduce is an all-gather + a reduce-scatter (two latencies, same bytes), and
        # the backward re-gathers the sequence-sharded inputs of the two column-parallel regions
        gather = cm.all_gather_s(act_bytes, layout.tp, link) + sync
        return m * ((layers_here * (calls * 2 + 2) + 4) * gather + loss)
    return m * ((layers_here * calls + 2) * (cm.all_reduce_s(act_bytes, layout.tp, link) + sync) + loss)


def _data_parallel_and_update(spec, layout, gpu, link, compute, m, elem, precision, optimizer):
    """Exposed gradient-sync time, the optimizer's memory-bound update, and offload transfers."""
    n = layout.dp * layout.cp
    dense, expert = _stage_split(spec, layout, True, layout.pp == 1)
    params = dense[0] + expert[0]  # experts sync over fewer ranks; the same bytes move, so count them together
    grad_bytes = params * elem  # the trainable parameters' (LoRA: the adapters')
    held_bytes = (sum(dense) + sum(expert)) * elem  # what ZeRO-3 gathers (LoRA: frozen weights too)
    window = compute * 2.0 / 3.0 / m * gpu.overlap  # the last micro-batch's backward hides gradient buckets
    # one blocking start-up per 25 MB bucket (ZeRO-3: per unit, a block or the root, and use)
    syncs = math.ceil(grad_bytes / BUCKET_BYTES) * gpu.collective_sync_s if n > 1 else 0.0
    if layout.zero_stage == 0:
        exposed = max(0.0, cm.all_reduce_s(grad_bytes, n, link) + syncs - window)
    elif layout.zero_stage in (1, 2):  # reduce-scatter gradients, all-gather updated parameters after the step
        exposed = (max(0.0, cm.reduce_scatter_s(grad_bytes, n, link) + syncs - window)
                   + cm.all_gather_s(grad_bytes, n, link) + syncs)
    elif gpu.hbm_efficiency and n > 1:  # GPU kernel model: each unit's gathers behind its neighbour's compute
        exposed = m * zero3_exposed(spec, layout, link, compute / m, elem, grad_bytes / max(held_bytes, 1.0))
    else:  # gather weights for forward and backward, reduce-scatter gradients, every micro-batch; prefetched
        z3 = m * (2 * cm.all_gather_s(held_bytes, n, link) + cm.reduce_scatter_s(grad_bytes, n, link))
        units = spec.layers / layout.pp + 1
        z3 += m * 3 * units * gpu.collective_sync_s if n > 1 else 0.0
        exposed = max(0.0, z3 - compute * gpu.overlap)
    shard = params / (n if layout.zero_stage >= 1 else 1)
    state = model_state_bytes(shard, zero_stage=0, dp=1, precision=precision, optimizer=optimizer)
    if layout.offload:  # gradients down, parameters up over PCIe; the host runs the update
        offload = 2 * shard * elem / gpu.host_bytes_per_s + shard / gpu.host_adam_params_per_s
        return exposed, 0.0, offload
    return exposed, 2 * state["total"] / gpu.hbm_bytes_per_s, 0.0  # read and write every state once


def estimate(spec, layout, gpu, global_batch: int, seq: int | None = None, precision: str = "mixed",
             optimizer: str = "adam", software: Software = TESSERA) -> Estimate:
    """Memory and time of ``layout``; see the module docstring. ``seq`` defaults to the model's."""
    seq = seq or spec.seq
    mem, host = memory_per_rank(spec, layout, global_batch, seq, precision, optimizer)
    parts, total = step_time(spec, layout, gpu, global_batch, seq, precision, optimizer, software)
    tokens = global_batch * seq
    mfu = model_flops(spec, tokens, seq) / (total * layout.world * gpu.peak_flops)
    m = layout.microbatches(global_batch)
    bubble = bubble_fraction(layout.schedule, layout.pp, m, layout.virtual_stages) if layout.pp > 1 else 0.0
    fits = mem["total"] <= gpu.memory_bytes * gpu.usable_fraction
    return Estimate(layout, mem, host, parts, total, tokens / total, mfu, bubble, fits)


def _dp_bytes(spec, layout, m: int, elem: int) -> float:
    """The dp axis of :func:`comm_bytes`."""
    dense, expert = _stage_split(spec, layout, True, layout.pp == 1)
    # experts are replicated over dp·cp/ep ranks only: with ep = dp·cp nothing reduces their gradients
    replicas = layout.dp * layout.cp
    if replicas == 1:
        return 0.0
    reduced = replicas // layout.ep > 1
    grad = (dense[0] + (expert[0] if reduced else 0.0)) * elem  # trainable (LoRA: adapters)
    held = (sum(dense) + (sum(expert) if reduced else 0.0)) * elem  # ZeRO-3 gathers frozen weights too
    # ZeRO-3's root unit (tessera's block policy leaves only the final norm in it) stays gathered from
    # forward to backward: one gather fewer per micro-batch; LoRA: the frozen embedding has no backward
    root = spec.hidden * elem if layout.pp == 1 else 0.0
    if spec.lora_rank and not spec.tied:
        root += spec.embedding_params() / layout.tp * elem
    # ZeRO-2 keeps no whole gradient to accumulate in: it reduce-scatters every backward (a pipeline's once)
    zero2 = (m if layout.pp == 1 else 1) * grad + grad
    return {0: grad, 1: 2 * grad, 2: zero2, 3: (2 * held + grad - root) * m}[layout.zero_stage]


def comm_bytes(spec, layout, global_batch: int, seq: int, precision: str = "mixed") -> dict:
    """Payload bytes per rank per step on the dp and tp axes, in tessera.comm's ledger convention (the
    full, unsharded size for gathers and scatters), as Megatron-style implementations issue them:

    dp: DDP all-reduces the gradients once (G = local trainable parameters × element size); ZeRO-1
    reduce-scatters them and all-gathers the updated parameters (2G), ZeRO-2 reduce-scatters every
    micro-batch's ((m + 1)G; a pipeline's once); ZeRO-3 gathers every unit's parameters
    for forward and again for backward and reduce-scatters its gradients on every micro-batch (3G·m, the
    ZeRO paper's 1.5× of DDP's traffic; LoRA: the gathers move the frozen weights too, (2P + G)·m), less
    one gather of the root unit, which stays gathered from forward to backward (tessera's block wrap
    policy leaves only the final norm in it), and with LoRA of the (untied) embedding, whose unit needs no
    backward. Expert gradients are reduced over their dp·cp/ep replicas
    only, so with ep = dp·cp the dense gradients alone cross the dp axis.
    tp: per layer and micro-batch, 2 all-reduces forward and 2 backward of the activation a = b·s·h·e;
    with sequence parallelism each becomes an all-gather plus a reduce-scatter (twice the payload count,
    the same wire traffic), and, as Megatron-LM does, the backward re-gathers the sequence-sharded input of
    both column-parallel blocks instead of saving it gathered (2 more all-gathers). Around the layers: the
    vocab-parallel embedding's forward all-reduce and the column-parallel head's backward all-reduce
    (2a; 4a as gathers/scatters with SP), the vocab-parallel cross-entropy's three fp32 per-token
    reductions (max, sum of exponentials, target logit), and with SP the all-reduce of the norm weights'
    gradients, which each rank saw for its slice of the sequence (LoRA: frozen, none; instead each
    backward all-reduces the gradient of every adapter factor tp keeps whole, and skips the first layer's
    input gradient: below it only the frozen embedding).
    pp: per micro-batch, each of the v·p − 1 stage boundaries carries the activation forward and its
    gradient backward (b·s·h·e, /t with SP); a rank is at 2(vp − 1)/p boundary ends on average, and the
    ledger counts a message at both ends (send and receive): 4m(vp − 1)/p · a.
    cp (ring attention): per layer and micro-batch, this rank's k and v block (2·b·(s/cp)·kv·e/t) goes
    cp − 1 steps round the ring forward and again backward, where a float32 dk/dv accumulator travels
    cp steps with it; counted at both ends.
    ep: per MoE layer and micro-batch, dispatch and combine all-to-alls forward and backward of the
    b·s·k token rows (no token dropped; capacity drops make the measured figure smaller).
    """
    elem = ELEM_BYTES[precision]
    m = layout.microbatches(global_batch)
    out = {"dp": _dp_bytes(spec, layout, m, elem), "tp": 0.0, "pp": 0.0, "cp": 0.0, "ep": 0.0}
    if layout.tp > 1:
        tokens = layout.micro_batch * (seq // layout.cp)
        act = tokens * spec.hidden * elem
        per_collective = 2 if layout.sp else 1
        layers = spec.layers / layout.pp * act * (10 if layout.sp else 4)
        around = 2 * act * per_collective + 3 * tokens * 4
        norms = (spec.layers / layout.pp * spec.norm_params() + spec.hidden) * elem if layout.sp else 0.0
        adapters = spec.layers / layout.pp * sum(s * n for s, n in spec.replicated_adapter_factors()) * elem
        # LoRA: nothing below the first layer needs a gradient, so its input's backward reduction is skipped
        # (the first stage's; averaged over the stages)
        first = act / layout.pp if spec.lora_rank else 0.0
        out["tp"] = m * (layers + around + adapters - first) + (0.0 if spec.lora_rank else norms)
    seq_local = seq // layout.cp
    act = layout.micro_batch * seq_local * spec.hidden * elem / (layout.tp if layout.sp else 1)
    if layout.pp > 1:
        out["pp"] = 4 * m * (layout.virtual_stages * layout.pp - 1) / layout.pp * act
    if layout.cp > 1:
        kv = 2 * layout.micro_batch * seq_local * spec.kv_heads * spec.head_dim / layout.tp * elem
        shifts = 2 * (layout.cp - 1) * kv + layout.cp * kv * 4 / elem
        out["cp"] = 2 * m * spec.layers / layout.pp * shifts
    if layout.ep > 1:
        rows = layout.micro_batch * seq_local * spec.top_k * spec.hidden * elem
        out["ep"] = 4 * m * spec.layers * spec.moe_fraction / layout.pp * rows
    return out
