"""Memory per rank and time per step of one model, layout and GPU: the planner's core evaluation.

Memory is that of the busiest pipeline stage (the first holds the embedding and the most micro-batches
in flight, the last the output layer and logits). Time: the stage's compute (at peak × efficiency) and
its tensor-, context- and expert-parallel collectives, stretched by the pipeline bubble, plus the
pipeline's point-to-point sends on the critical path, the exposed part of the data-parallel gradient
synchronisation, and the optimizer update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.planner import comm_model as cm
from tessera.planner.flops import bubble_fraction, model_flops, recompute_flops
from tessera.planner.memory import (activation_bytes_per_layer, embedding_bytes, inflight_microbatches,
                                    llama_activation_bytes_per_layer, logits_bytes, model_state_bytes)

ELEM_BYTES = {"mixed": 2, "fp32": 4}


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
    """(dense, expert) parameters one rank of a stage holds."""
    per_stage = spec.layers / layout.pp
    dense = per_stage * spec.dense_layer_params() / layout.tp
    if first:
        dense += spec.embedding_params() / layout.tp
    if last:
        head = spec.head_params() + (spec.vocab * spec.hidden if spec.tied and layout.pp > 1 else 0)
        dense += head / layout.tp
    expert = per_stage * spec.expert_layer_params() / (layout.ep * layout.tp)
    return dense, expert


def _layer_activations(spec, layout, seq_local: int, elem: int) -> float:
    kw = dict(tp=layout.tp, sequence_parallel=layout.sp, recompute=layout.recompute)
    if spec.arch == "gpt":
        return activation_bytes_per_layer(seq_local, layout.micro_batch, spec.hidden, spec.heads, **kw) * elem / 2
    return llama_activation_bytes_per_layer(seq_local, layout.micro_batch, spec.hidden, spec.heads,
                                            spec.kv_heads, spec.ffn, elem_bytes=elem, **kw)


def stage_memory(spec, layout, global_batch: int, seq: int, precision: str, optimizer: str,
                 first: bool, last: bool) -> tuple[dict, float]:
    """(device bytes by kind, host bytes) for one rank of the first and/or last pipeline stage."""
    elem = ELEM_BYTES[precision]
    shard = layout.dp * layout.cp  # cp ranks hold the same weights, so ZeRO shards over dp × cp
    dense, expert = _stage_params(spec, layout, first, last)
    states = model_state_bytes(dense, zero_stage=layout.zero_stage, dp=shard, precision=precision,
                               optimizer=optimizer)
    if expert:
        ex = model_state_bytes(expert, zero_stage=layout.zero_stage, dp=max(1, shard // layout.ep),
                               precision=precision, optimizer=optimizer)
        states = {k: states[k] + ex[k] for k in states}
    host = 0.0
    if layout.offload:
        host, states["optimizer"] = states["optimizer"], 0.0
    m = layout.microbatches(global_batch)
    seq_local = seq // layout.cp
    inflight = inflight_microbatches(layout.schedule, layout.pp, m, layout.virtual_stages) if first else (
        float(m) if layout.schedule == "gpipe" else 1.0)
    acts = _layer_activations(spec, layout, seq_local, elem) * spec.layers / layout.pp * inflight
    if first:
        acts += inflight * embedding_bytes(seq_local, layout.micro_batch, spec.hidden, tp=layout.tp,
                                           sequence_parallel=layout.sp, dropout=spec.arch == "gpt")
    if last:
        acts += logits_bytes(seq_local, layout.micro_batch, spec.hidden, spec.vocab, tp=layout.tp, elem_bytes=elem)
    buffers = 0.0
    if layout.zero_stage == 3 and shard > 1:  # this layer's and the prefetched next layer's gathered weights
        buffers += 2 * spec.dense_layer_params() / layout.tp * elem
    if layout.pp > 1:  # one activation to send and one received, per direction
        buffers += 4 * layout.micro_batch * seq_local * spec.hidden * elem / (layout.tp if layout.sp else 1)
    mem = {"params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"],
           "activations": acts, "buffers": buffers}
    mem["total"] = sum(mem.values())
    return mem, host


def memory_per_rank(spec, layout, global_batch: int, seq: int, precision: str = "mixed",
                    optimizer: str = "adam") -> tuple[dict, float]:
    """Device bytes of the busiest stage's rank, and its host bytes."""
    if layout.pp == 1:
        return stage_memory(spec, layout, global_batch, seq, precision, optimizer, True, True)
    first = stage_memory(spec, layout, global_batch, seq, precision, optimizer, True, False)
    last = stage_memory(spec, layout, global_batch, seq, precision, optimizer, False, True)
    return max(first, last, key=lambda pair: pair[0]["total"])


def step_time(spec, layout, gpu, global_batch: int, seq: int, precision: str = "mixed",
              optimizer: str = "adam") -> tuple[dict, float]:
    """(seconds by part, total seconds) of one optimizer step."""
    elem = ELEM_BYTES[precision]
    links = cm.axis_links(gpu, layout)
    m = layout.microbatches(global_batch)
    tokens = global_batch * seq
    seq_local = seq // layout.cp
    layers_here = spec.layers / layout.pp
    flops = model_flops(spec, tokens, seq) + recompute_flops(spec, tokens, seq, layout.recompute)
    compute = flops / layout.world / (gpu.peak_flops * gpu.compute_efficiency)
    # tensor parallel: 2 all-reduces forward, 2 backward per layer (as AG + RS with SP: same bytes);
    # 2 more when full recomputation re-runs the forward. On the critical path (nothing to overlap).
    act_bytes = layout.micro_batch * seq_local * spec.hidden * elem
    tp_calls = 4 + (2 if layout.recompute == "full" else 0)
    tp = layers_here * m * tp_calls * cm.all_reduce_s(act_bytes, layout.tp, links["tp"])
    if layout.sp:  # each all-reduce is an all-gather + a reduce-scatter (two latencies, same bytes), and the
        # backward re-gathers the sequence-sharded inputs of the two column-parallel regions (Megatron-LM)
        gather = cm.all_gather_s(act_bytes, layout.tp, links["tp"])
        tp = layers_here * m * (tp_calls * 2 + 2) * gather
    # context parallel: keys and values gathered forward, gathered again and reduce-scattered backward
    kv_bytes = 2 * layout.micro_batch * seq * spec.head_dim * spec.kv_heads / layout.tp * elem
    cp = layers_here * m * 3 * cm.all_gather_s(kv_bytes, layout.cp, links["cp"])
    # expert parallel: dispatch and combine all-to-all, forward and backward
    ep = 0.0
    if spec.experts > 1:
        ep = layers_here * m * 4 * cm.all_to_all_s(act_bytes * spec.top_k, layout.ep, links["ep"])
    bubble = bubble_fraction(layout.schedule, layout.pp, m, layout.virtual_stages) if layout.pp > 1 else 0.0
    stage = compute + tp + cp + ep
    pipeline = stage / (1.0 - bubble)
    p2p = 0.0
    if layout.pp > 1:
        sent = act_bytes / (layout.tp if layout.sp else 1)
        p2p = 2 * (m + layout.pp - 1) * layout.virtual_stages * cm.p2p_s(sent, links["pp"])
    dp_exposed, optim, offload = _data_parallel_and_update(spec, layout, gpu, links["dp"], compute, m, elem,
                                                           precision, optimizer)
    parts = {"compute": compute, "tp": tp, "cp": cp, "ep": ep, "bubble": pipeline - stage, "pp_p2p": p2p,
             "dp_exposed": dp_exposed, "optimizer": optim, "offload": offload}
    return parts, pipeline + p2p + dp_exposed + optim + offload


def _data_parallel_and_update(spec, layout, gpu, link, compute, m, elem, precision, optimizer):
    """Exposed gradient-sync time, the optimizer's memory-bound update, and offload transfers."""
    n = layout.dp * layout.cp
    dense, expert = _stage_params(spec, layout, True, layout.pp == 1)
    params = dense + expert  # experts sync over fewer ranks; the same bytes move, so count them together
    grad_bytes = params * elem
    window = compute * 2.0 / 3.0 / m * gpu.overlap  # the last micro-batch's backward hides gradient buckets
    if layout.zero_stage == 0:
        exposed = max(0.0, cm.all_reduce_s(grad_bytes, n, link) - window)
    elif layout.zero_stage in (1, 2):  # reduce-scatter gradients, all-gather updated parameters after the step
        exposed = max(0.0, cm.reduce_scatter_s(grad_bytes, n, link) - window) + cm.all_gather_s(grad_bytes, n, link)
    else:  # gather weights for forward and backward, reduce-scatter gradients, every micro-batch; prefetched
        z3 = m * (2 * cm.all_gather_s(grad_bytes, n, link) + cm.reduce_scatter_s(grad_bytes, n, link))
        exposed = max(0.0, z3 - compute * gpu.overlap)
    shard = params / (n if layout.zero_stage >= 1 else 1)
    state = model_state_bytes(shard, zero_stage=0, dp=1, precision=precision, optimizer=optimizer)
    if layout.offload:  # gradients down, parameters up over PCIe; the host runs the update
        offload = 2 * shard * elem / gpu.host_bytes_per_s + shard / gpu.host_adam_params_per_s
        return exposed, 0.0, offload
    return exposed, 2 * state["total"] / gpu.hbm_bytes_per_s, 0.0  # read and write every state once


def estimate(spec, layout, gpu, global_batch: int, seq: int | None = None, precision: str = "mixed",
             optimizer: str = "adam") -> Estimate:
    """Memory and time of ``layout``; see the module docstring. ``seq`` defaults to the model's."""
    seq = seq or spec.seq
    mem, host = memory_per_rank(spec, layout, global_batch, seq, precision, optimizer)
    parts, total = step_time(spec, layout, gpu, global_batch, seq, precision, optimizer)
    tokens = global_batch * seq
    mfu = model_flops(spec, tokens, seq) / (total * layout.world * gpu.peak_flops)
    m = layout.microbatches(global_batch)
    bubble = bubble_fraction(layout.schedule, layout.pp, m, layout.virtual_stages) if layout.pp > 1 else 0.0
    fits = mem["total"] <= gpu.memory_bytes * gpu.usable_fraction
    return Estimate(layout, mem, host, parts, total, tokens / total, mfu, bubble, fits)


def comm_bytes(spec, layout, global_batch: int, seq: int, precision: str = "mixed") -> dict:
    """Payload bytes per rank per step on the dp and tp axes, in tessera.comm's ledger convention (the
    full, unsharded size for gathers and scatters), as Megatron-style implementations issue them:

    dp: DDP all-reduces the gradients once (G = local parameters × element size); ZeRO-1/2 reduce-scatter
    them and all-gather the updated parameters (2G); ZeRO-3 gathers every unit's parameters for forward
    and again for backward and reduce-scatters its gradients on every micro-batch (3G·m: the ZeRO
    paper's 1.5× of DDP's traffic; an engine that keeps the root unit gathered from forward to backward
    saves one gather of the embedding and head).
    tp: per layer and micro-batch, 2 all-reduces forward and 2 backward of the activation a = b·s·h·e;
    with sequence parallelism each becomes an all-gather plus a reduce-scatter (twice the payload count,
    the same wire traffic), and, as Megatron-LM does, the backward re-gathers the sequence-sharded input of
    both column-parallel blocks instead of saving it gathered (2 more all-gathers). Around the layers: the vocab-parallel embedding's forward all-reduce and the
    column-parallel head's backward all-reduce (2a; 4a as gathers/scatters with SP), the vocab-parallel
    cross-entropy's three fp32 per-token reductions (max, sum of exponentials, target logit), and with
    SP the all-reduce of the norm weights' gradients, which each rank saw for its slice of the sequence.
    Pipeline sends, context- and expert-parallel traffic are in the time model only.
    """
    elem = ELEM_BYTES[precision]
    m = layout.microbatches(global_batch)
    dense, expert = _stage_params(spec, layout, True, layout.pp == 1)
    grad = (dense + expert) * elem
    out = {"dp": 0.0, "tp": 0.0}
    if layout.dp * layout.cp > 1:
        out["dp"] = {0: grad, 1: 2 * grad, 2: 2 * grad, 3: 3 * grad * m}[layout.zero_stage]
    if layout.tp > 1:
        tokens = layout.micro_batch * (seq // layout.cp)
        act = tokens * spec.hidden * elem
        per_collective = 2 if layout.sp else 1
        layers = spec.layers / layout.pp * act * (10 if layout.sp else 4)
        around = 2 * act * per_collective + 3 * tokens * 4
        norms = (spec.layers / layout.pp * spec.norm_params() + spec.hidden) * elem if layout.sp else 0.0
        out["tp"] = m * (layers + around) + norms
    return out
