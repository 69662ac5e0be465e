"""A calibrated CPU's compute seconds per step (tessera.planner.local): matmuls at the measured layer
rate, attention at its own rate and per-row cost (ring attention by the scores each rank computes), the
non-matmul kernels by the activation bytes they save, and a fixed cost per layer and micro-batch. A GPU
with a kernel model is timed by tessera.planner.gpu_kernels instead."""

from __future__ import annotations

import dataclasses

from tessera.planner.flops import attention_flops, model_flops, recompute_flops, ring_scores
from tessera.planner.memory import ELEM_BYTES, layer_activation_bytes, logits_bytes


def activation_bytes_per_step(spec, layout, global_batch: int, seq: int, precision: str = "mixed") -> float:
    """Bytes one rank's layers save for backward over a whole step (every micro-batch, not the in-flight
    peak), without recomputation: what its non-matmul kernels write and read back, as the time model's
    elementwise term (recomputation saves memory, not these kernels: see ``step_time``)."""
    elem = ELEM_BYTES[precision]
    layout = dataclasses.replace(layout, recompute="none")
    seq_local = seq // layout.cp
    per_mb = layer_activation_bytes(spec, layout, seq_local, elem) * spec.layers / layout.pp
    per_mb += logits_bytes(seq_local, layout.micro_batch, spec.hidden, spec.vocab, tp=layout.tp,
                           elem_bytes=elem) / layout.pp
    return layout.microbatches(global_batch) * per_mb


def calibrated_compute_s(spec, layout, gpu, global_batch: int, seq: int, precision: str) -> float:
    """A rank's compute seconds per step on a calibrated machine (see tessera.planner.estimate.step_time)."""
    tokens = global_batch * seq
    flops = model_flops(spec, tokens, seq) + recompute_flops(spec, tokens, seq, layout.recompute)
    # full recomputation runs every layer's forward kernels again: a third more, as for the matmuls
    rerun = 4.0 / 3.0 if layout.recompute == "full" else 1.0
    elementwise = rerun * gpu.elementwise_s_per_byte * activation_bytes_per_step(spec, layout, global_batch, seq,
                                                                                 precision)
    # + 1: the embedding, or the head and loss
    calls = rerun * gpu.layer_call_s * layout.microbatches(global_batch) * (spec.layers / layout.pp + 1)
    matmul_s = (flops - attention_flops(spec, tokens, seq, layout.recompute)) / gpu.peak_flops
    ring_s = 0.0
    if layout.cp > 1 and (gpu.ring_forward_s or gpu.ring_backward_s):
        ring_s = ring_attention_s(spec, layout, gpu, global_batch, seq)
    else:
        matmul_s += sdpa_s(spec, gpu, tokens, seq, layout.recompute)
    if precision == "mixed" and gpu.half_flops:  # every product in bf16: both rates scale alike
        matmul_s *= gpu.peak_flops / gpu.half_flops
    return (matmul_s / layout.world + ring_s + elementwise + calls) / gpu.compute_efficiency


def sdpa_s(spec, gpu, tokens: float, seq: int, recompute: str) -> float:
    """Seconds of fused attention (SDPA) over ``tokens`` tokens, all ranks together: its score and value
    matmul FLOPs at ``attention_flops`` plus ``attention_row_s`` per token, head and layer where
    calibrated, the per-row cost re-run with the forward as its FLOPs are."""
    attention = attention_flops(spec, tokens, seq, recompute)
    seconds = attention / (gpu.attention_flops or gpu.peak_flops)
    if gpu.attention_row_s and attention:
        seconds += (gpu.attention_row_s * tokens * spec.heads * spec.layers
                    * attention / attention_flops(spec, tokens, seq))
    return seconds


def ring_attention_s(spec, layout, gpu, global_batch: int, seq: int) -> float:
    """One rank's seconds in ring attention's blockwise kernels per step: per layer and micro-batch the
    scores its zig-zag blocks compute (flops.ring_scores: L² + (cp − 1)·L²/2 per sequence and head,
    L = seq/cp, not the causal half a fused kernel skips to), each costing its matmul FLOPs at the
    attention rate plus the calibrated per-score seconds, forward and backward, and the forward again when
    a recomputation re-runs attention. In float32 whatever the precision, as the blocks compute."""
    scores = (layout.microbatches(global_batch) * spec.layers / layout.pp
              * ring_scores(layout.micro_batch, spec.heads / layout.tp, seq, layout.cp))
    forwards = 2.0 if layout.recompute != "none" else 1.0
    rate = gpu.attention_flops or gpu.peak_flops
    return scores * (forwards * (4.0 * spec.head_dim / rate + gpu.ring_forward_s)
                     + 10.0 * spec.head_dim / rate + gpu.ring_backward_s)
