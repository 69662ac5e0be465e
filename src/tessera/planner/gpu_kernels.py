"""The compute time of one pipeline stage on a GPU, kernel by kind: matmuls, attention, the rest.

A catalogue GPU with ``hbm_efficiency`` > 0 is timed by this model instead of "every FLOP at peak ×
efficiency" (calibrated CPUs keep their own measured rates, ``tessera.planner.estimate``). Per token of
one layer, on one tensor-parallel rank:

- **Matmuls** (6 FLOPs per weight in training, 2 more per weight a recomputation re-runs) at
  ``compute_efficiency`` of peak, as cuBLAS reaches on large shapes, times each GEMM's wave efficiency:
  its 128 × 128 output tiles run one per multiprocessor (``sm_count``) in waves, so a narrow
  tensor-parallel slice or a short micro-batch leaves multiprocessors idle.
- **Attention's score and value products**: a fused (flash) kernel computes the causal half at
  ``attention_flops``; an unfused one (Megatron-LM 2021) computes the whole s × s product as batched
  matmuls and writes, softmaxes, drops out and reads back the scores (``6·a·s`` elements per token
  forward, a = heads).
- **Everything else** (norms, rotary embedding, activation function, residual adds, dropout, the loss
  over the vocabulary): charged by the bytes it moves at ``hbm_efficiency`` of the HBM bandwidth. Bytes
  per token per layer, forward, counted from the kernels each implementation launches (below); backward
  moves twice that; a recomputation re-runs the forward's kernels. ``torch.compile`` fuses each chain of
  them into one kernel that reads its inputs and writes its outputs once.
- **Launch gaps**: ``kernel_gap_s`` of idle device between consecutive kernels of a layer.

Sources of the per-kernel counts: tessera's and torchtitan's eager Llama block (RMSNorm in fp32 as five
kernels, complex rotary embedding, SwiGLU as silu then multiply, two residual adds); Megatron-LM's fused
kernels for GPT (fused LayerNorm, bias-GeLU, bias-dropout-add, scale-mask-softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.planner import comm_model as cm


@dataclass(frozen=True)
class Software:
    """What the training code does that changes its speed but not its layout (a property of the code
    that ran, not of the GPU). tessera: SDPA attention, eager kernels unless ``kernels.compile``, data-
    parallel reduction overlapped with the backward, selective recomputation of non-matmul kernels only."""

    attention: str = "flash"  # "flash": fused causal kernel; "unfused": scores materialised (Megatron 2021)
    compile: bool = False  # elementwise chains fused by torch.compile
    dp_overlap: bool = True  # gradient buckets reduced during the backward (False: after it, exposed)
    p2p_scatter_gather: bool = False  # pipeline sends split over the tp ranks and re-gathered (Megatron-LM)
    selective_matmul_share: float = 0.0  # selective recompute: share of matmul forwards re-run too (torchtitan's op policy: 0.5)


TESSERA = Software()


def _elementwise_bytes(spec, tp: int, sp: bool, compiled: bool, elem: int) -> float:
    """Bytes the non-matmul kernels of one layer's forward move per token on one tp rank (attention's
    score matrix apart). Llama eager: two RMSNorms in fp32 (≈ 24h bytes each), rotary embedding of q and
    k through complex fp32 (≈ 16 bytes per element of q and k), the q/k/v transposes (≈ 6h), two residual
    adds (3 tensors each), SwiGLU as silu (read f, write f) and a multiply (read 2f, write f); compiled:
    one norm kernel each (read and write once, the residual add fused in), rotary fused with the
    projections' outputs, SwiGLU as one kernel (read 2f, write f). GPT with Megatron's fused kernels:
    two LayerNorms (2h each), bias-GeLU (8h), two bias-dropout-adds (3.5h each)."""
    h, f = spec.hidden, spec.ffn
    scale = elem / 2.0  # the counts below are for 2-byte activations
    kv = spec.kv_heads * spec.head_dim
    if spec.arch == "gpt":  # 11 h-wide and 2 f-wide (f = 4h) tensors read or written, 2 bytes each
        return scale * (22.0 * h / (tp if sp else 1) + 4.0 * f / tp)
    top_k = spec.top_k if spec.experts > 1 else 1
    if compiled:
        h_bytes, q_bytes, f_bytes = 8.0 * h + 6.0 * h, 2.0 * (h + 2 * kv), 6.0 * f * top_k
    else:
        h_bytes, q_bytes, f_bytes = 48.0 * h + 12.0 * h + 6.0 * h, 16.0 * (h + kv), 10.0 * f * top_k
    return scale * (h_bytes / (tp if sp else 1) + (q_bytes + f_bytes) / tp)


def _kernels_per_layer(spec, compiled: bool) -> int:
    """Forward kernels of one layer (matmuls included): eager Llama ≈ 40, compiled ≈ 14; GPT with
    Megatron's fused kernels ≈ 20."""
    if spec.arch == "gpt":
        return 20
    return 14 if compiled else 40


@dataclass(frozen=True)
class StageTime:
    """Seconds one rank of the busiest stage computes per micro-batch, by kind."""

    matmul: float
    attention: float
    elementwise: float
    gaps: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.elementwise + self.gaps


TILE = 128  # output tile of a tensor-core GEMM kernel (cuBLAS / CUTLASS's 128 × 128 for large bf16 shapes)


def _wave_efficiency(rows: float, cols: float, sms: int) -> float:
    """Share of the multiprocessors a GEMM with a [rows, cols] output keeps busy: one 128 × 128 tile per
    multiprocessor, so fewer tiles than multiprocessors leave the rest idle. (With more tiles than
    multiprocessors the libraries balance the waves with their choice of tile shape and split-K.)"""
    tiles = math.ceil(rows / TILE) * math.ceil(cols / TILE)
    return min(1.0, tiles / sms)


def _matmul_rate(gpu, spec, layout, tokens: float) -> float:
    """FLOP/s of the layer matmuls: peak × efficiency × the wave efficiency of each linear's three GEMMs
    (forward [T, out], input gradient [T, in], weight gradient [in, out], on this rank's slice: a
    column-parallel weight's outputs / tp, a row-parallel one's inputs / tp; T the micro-batch's
    tokens), combined as the FLOP-weighted harmonic mean. Narrow tensor-parallel slices and short
    micro-batches leave multiprocessors idle."""
    full = gpu.peak_flops * gpu.compute_efficiency
    if not gpu.sm_count:
        return full
    weights = time = 0.0
    for n_in, n_out, split in spec.linear_shapes().values():
        n_in, n_out = (n_in, n_out / layout.tp) if split == "column" else (n_in / layout.tp, n_out)
        shapes = ((tokens, n_out), (tokens, n_in), (n_in, n_out))
        weights += n_in * n_out
        time += n_in * n_out * sum(1.0 / _wave_efficiency(r, c, gpu.sm_count) for r, c in shapes) / 3.0
    return full * weights / time


def stage_time(spec, layout, gpu, seq: int, elem: int, software: Software = TESSERA) -> StageTime:
    """One micro-batch's forward and backward (and recomputation) on one rank of the last stage: ``spec.layers
    / pp`` layers plus the output layer and the loss (the busiest stage)."""
    tp, rc = layout.tp, layout.recompute
    tokens = layout.micro_batch * seq / layout.cp
    layers = spec.layers / layout.pp
    matmul_rate = _matmul_rate(gpu, spec, layout, tokens)
    # matmul weights per token of one layer (active experts only), split over tp
    weights = (spec.matmul_params_per_token() - spec.vocab * spec.hidden) / spec.layers / tp
    rerun = {"full": 2.0, "selective": 2.0 * software.selective_matmul_share}.get(rc, 0.0)
    # LoRA: a frozen weight needs no weight gradient (4 FLOPs per token, not 6); its adapters cost 6
    a_dense, a_expert = spec.adapter_layer_params(tp)
    adapters = a_dense + a_expert * spec.top_k / spec.experts
    per_weight = 4.0 if spec.lora_rank else 6.0
    matmul = layers * tokens * ((per_weight + rerun) * weights + (6.0 + rerun) * adapters) / matmul_rate
    # attention products: 12·h·s FLOPs per token (fwd + bwd, whole square), 4·h·s more re-run by a full
    # (or Megatron-selective, unfused) recomputation
    att = 12.0 * spec.hidden * seq / tp
    rerun_att = 4.0 * spec.hidden * seq / tp if rc == "full" or (rc == "selective" and
                                                                  software.attention == "unfused") else 0.0
    passes = 3.0 + (1.0 if rc in ("full", "selective") else 0.0)  # fwd, bwd (2×), recompute
    hbm = gpu.hbm_bytes_per_s * gpu.hbm_efficiency
    scores = 0.0
    if software.attention == "flash":
        attention = layers * tokens * (att + rerun_att) / 2.0 / (gpu.attention_flops or gpu.peak_flops)
    else:
        attention = layers * tokens * (att + rerun_att) / matmul_rate
        # scores written, softmaxed (read + write), dropped out (read + write + 1-byte mask), read by the
        # value product: per token a·s elements each time, /tp heads
        score_passes = 3.0 + (1.0 if rerun_att else 0.0)
        scores = layers * tokens * score_passes * (6.0 * elem + 1.0) * spec.heads * seq / tp
    compiled = software.compile
    elementwise_bytes = layers * tokens * passes * _elementwise_bytes(spec, tp, layout.sp, compiled, elem)
    # output layer (a matmul) and the loss over the vocabulary in fp32: eager ≈ 30 bytes per logit (cast,
    # log-softmax, its gradient, cast back), compiled ≈ 10
    matmul += tokens * per_weight * spec.vocab * spec.hidden / tp / matmul_rate
    elementwise_bytes += tokens * (10.0 if compiled else 30.0) * spec.vocab / tp
    kernels = layers * _kernels_per_layer(spec, compiled) * passes
    return StageTime(matmul=matmul, attention=attention, elementwise=(elementwise_bytes + scores) / hbm,
                     gaps=kernels * gpu.kernel_gap_s)


def zero3_exposed(spec, layout, link, hidden_per_mb: float, elem: int, grad_share: float) -> float:
    """ZeRO-3 communication one micro-batch cannot hide (catalogue GPUs): the embedding's gather opens
    the forward and its reduce-scatter closes the backward, exposed; each layer's (and the head's) gather
    is prefetched behind the previous unit's forward, its backward gather and reduce-scatter behind the
    neighbour's backward — a unit whose collectives outlast that compute shows the rest. A layer's
    forward is a third of its share of ``hidden_per_mb`` (what the data-parallel side may hide behind:
    the stage's compute, 0 where the code does not overlap), its backward two thirds. ``grad_share``:
    reduced bytes per gathered byte (LoRA: the adapters only)."""
    n, layers = layout.dp * layout.cp, spec.layers / layout.pp
    # the busiest stage's units, as _stage_split counts them: the embedding, and the head without a pipeline
    embed = spec.embedding_params() / layout.tp * elem
    head = spec.head_params() / layout.tp * elem if layout.pp == 1 else 0.0
    layer = (spec.dense_layer_params() / layout.tp + spec.expert_layer_params() / (layout.ep * layout.tp)) * elem
    forward = hidden_per_mb / 3.0 / (layers + 1)
    backward = 2.0 * forward

    def gather(nbytes):
        return cm.all_gather_s(nbytes, n, link)

    def scatter(nbytes):
        return cm.reduce_scatter_s(nbytes * grad_share, n, link)

    def left_exposed(nbytes):  # a unit's gathers and reduce-scatter past its neighbours' compute
        g = gather(nbytes)
        return max(0.0, g - forward) + max(0.0, g + scatter(nbytes) - backward)

    per_layer = left_exposed(layer)  # the layers are alike: one α–β evaluation serves them all
    exposed = gather(embed) + scatter(embed)
    for _ in range(round(layers)):  # added one by one, not multiplied: the same float sum as per unit
        exposed += per_layer
    if head:
        exposed += left_exposed(head)
    return exposed
