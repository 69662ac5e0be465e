"""Memory per rank: model states (ZeRO accounting), activations (Korthikanti et al. 2022), buffers.

Model states, after the ZeRO paper (Rajbhandari et al. 2019, §3.1 and Figure 1): with Ψ parameters,
mixed-precision Adam holds 2Ψ of fp16/bf16 parameters, 2Ψ of gradients and KΨ of optimizer states with
K = 12 (fp32 master weights, momentum, variance); plain fp32 training holds 4Ψ + 4Ψ + 8Ψ. ZeRO stage 1
divides the optimizer states by the data-parallel degree N_d, stage 2 also the gradients, stage 3 also the
parameters.

Activations, after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", Table 2): bytes saved for backward by one transformer layer with 2-byte activations, for sequence
length s, micro-batch b, hidden h, heads a and tensor-parallel degree t.
"""

from __future__ import annotations

ELEM_BYTES = {"mixed": 2, "fp32": 4}  # bytes of one activation element by precision
# Optimizer-state bytes per parameter (beyond the parameters and gradients themselves).
_OPTIMIZER_K = {
    ("mixed", "adam"): 12,  # fp32 master copy + fp32 momentum + fp32 variance
    ("mixed", "sgd"): 8,  # fp32 master copy + fp32 momentum
    ("fp32", "adam"): 8,  # momentum + variance
    ("fp32", "sgd"): 4,  # momentum
}
_PARAM_BYTES = {"mixed": 2, "fp32": 4}
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "host", "disk")
# RAM that disk offload keeps while the update streams the state through it (tessera.zero.offload): at most
# 3 chunks (the one written back, the one updated, the one read ahead) of fp32 master, exp_avg and exp_avg_sq
# mapped in, plus 2 fp32 chunk temporaries of the update; chunks of the default zero.offload_chunk_mb = 16 MB
DISK_STAGING_BYTES = (3 * 3 + 2) * 16 * 2**20


def offload_kind(value) -> str:
    """An offload setting (a Layout's, or ``zero.offload``) as "none", "host" or "disk" (True: host)."""
    if value in (False, None, "", "none", "false"):
        return "none"
    if value in (True, "host", "true"):
        return "host"
    if value == "disk":
        return "disk"
    raise ValueError(f"offload must be one of {', '.join(OFFLOAD)} (or a boolean), got {value!r}")


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def model_state_bytes(num_params: float, *, zero_stage: int, dp: int, precision: str = "mixed",
                      optimizer: str = "adam", zero1_reduced: bool = False) -> dict:
    """Bytes per rank of parameters, gradients and optimizer states under ZeRO stage 0–3 over ``dp`` ranks.

    ``optimizer`` 'adam' (also AdamW) or 'sgd' (with momentum). Returns {params, grads, optimizer, total}.
    ``zero1_reduced``: stage 1 as tessera (and DeepSpeed) run it outside a pipeline, which free the full
    gradients once reduced and keep the 1/``dp`` slice (the paper's P_os keeps them whole: the default).
    """
    _check_choice("precision", precision, ("mixed", "fp32"))
    _check_choice("optimizer", optimizer, ("adam", "adamw", "sgd"))
    _check_choice("zero_stage", zero_stage, (0, 1, 2, 3))
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    k = _OPTIMIZER_K[(precision, "adam" if optimizer == "adamw" else optimizer)]
    per = _PARAM_BYTES[precision]
    params = per * num_params / (dp if zero_stage >= 3 else 1)
    grads = per * num_params / (dp if zero_stage >= 2 or (zero_stage == 1 and zero1_reduced) else 1)
    opt = k * num_params / (dp if zero_stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes one GPT layer saves for backward.

    none:       sbh(34 + 5as/h) without TP; sbh(10 + 24/t + 5as/(ht)) with TP; sbh/t·(34 + 5as/h) with TP+SP.
    selective:  attention's softmax/dropout (the 5as/h term) is recomputed: sbh(10 + 24/t); sbh·34/t with SP.
    full:       only the layer's input is kept: 2sbh.
    """
    _check_choice("recompute", recompute, RECOMPUTE)
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    attn_scores = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sequence_parallel:
        return sbh / t * (34.0 + attn_scores)
    return sbh * (10.0 + 24.0 / t + attn_scores / t)


def llama_activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, kv_heads: int,
                                     ffn: int, *, tp: int = 1, sequence_parallel: bool = False,
                                     recompute: str = "none", elem_bytes: int = 2) -> float:
    """Bytes one Llama-style layer (tessera's reference block) saves for backward, with a fused attention
    kernel (no s×s scores kept), counted tensor by tensor per token (e bytes per element):

    - residual stream, replicated across TP unless SP: each RMSNorm keeps its input and normalised value,
      the projections after it keep the norm's output: 2 norms × 3h;
    - attention, split by TP: rotated q, k and v as the kernel saw them (after repeating kv heads when
      kv < heads, since the repeat copies), the kernel's output: 2h + 2·kv_width;
    - SwiGLU, split by TP: w1 out, silu out, w3 out and their product: 4f;
    - fp32 extras: two reciprocal-rms values and a log-sum-exp per head.
    RoPE's multiplies keep only the constant tables (a bias-free product saves the other operand).
    selective recompute re-runs the attention kernel, which saves nothing more here; full keeps e·h.
    """
    _check_choice("recompute", recompute, RECOMPUTE)
    e, t = elem_bytes, tp
    tokens = seq * micro_batch
    if recompute == "full":
        return float(e * tokens * hidden)
    kv_width = hidden if kv_heads < heads else hidden // heads * kv_heads
    split = e * (2 * hidden + 2 * kv_width + 4 * ffn) + 4 * heads
    replicated = e * 6 * hidden + 2 * 4
    return float(tokens * (replicated / (t if sequence_parallel else 1) + split / t))


def stage_inflight(stage: int, schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations pipeline stage ``stage`` (0 … pp−1) holds at its peak, in units of
    one micro-batch through that stage's layers, for m micro-batches:

    - GPipe: all m (every forward runs before any backward);
    - 1F1B: min(p − s, m) (stage s runs p − s − 1 warm-up forwards, then one more before its first
      backward);
    - ZB-H1: min(p, m) on every stage: stage s holds back the weight gradients of its first s micro-batches,
      so up to p micro-batches wait for their W (each still holding what its W reads: the inputs and output
      gradients of its linears, counted here as the whole micro-batch's activations);
    - interleaved 1F1B (v chunks per stage): Megatron-LM's warm-up of rank s, 2(p − s − 1) + (v − 1)·p
      chunk forwards, plus the one before the first backward, capped at the m·v chunk forwards there
      are, / v. Uncapped, stage 0 holds p + (p − 1)/v = p·(1 + (p − 1)/(p·v)) (Korthikanti et al. 2022
      §4.2.3) and the last stage ((v − 1)·p + 1)/v; with m = p the cap leaves stage 0 all m.

    These are the peaks of ``tessera.pipeline.schedules``' action lists (tests/test_planner_local.py).
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    if pp == 1 or schedule == "none":
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(pp - stage, microbatches))
    if schedule == "zb-h1":
        return float(min(pp, microbatches))
    if schedule == "interleaved":
        v = virtual_stages
        return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, microbatches * v) / v
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def inflight_microbatches(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """:func:`stage_inflight` of the first stage, the one holding the most micro-batches."""
    return stage_inflight(0, schedule, pp, microbatches, virtual_stages)


def last_stage_inflight(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """:func:`stage_inflight` of the last stage (1 for 1F1B: each forward is followed by its backward)."""
    return stage_inflight(pp - 1, schedule, pp, microbatches, virtual_stages)


def logits_bytes(seq: int, micro_batch: int, hidden: int, vocab: int, *, tp: int = 1, elem_bytes: int = 2) -> float:
    """The output layer (cf. Korthikanti §4.3): the final norm's input, normalised value and output (3·e·sbh,
    /t with TP as Megatron shards them with SP) and the fp32 log-softmax the cross-entropy keeps (4·sbV/t)."""
    return seq * micro_batch * (3 * elem_bytes * hidden + 4 * vocab) / tp


def embedding_bytes(seq: int, micro_batch: int, hidden: int, *, tp: int = 1, sequence_parallel: bool = False,
                    dropout: bool = True) -> float:
    """The input embedding's dropout mask (sbh bytes per micro-batch, /t with SP); 0 without dropout."""
    if not dropout:
        return 0.0
    return seq * micro_batch * hidden / (tp if sequence_parallel else 1)


def layer_activation_bytes(spec, layout, seq_local: int, elem: int) -> float:
    """Bytes one transformer layer of ``spec`` saves for backward on one micro-batch of ``seq_local``
    tokens per sequence under ``layout`` (tensor/sequence parallelism, recomputation, MoE FFNs)."""
    kw = dict(tp=layout.tp, sequence_parallel=layout.sp, recompute=layout.recompute)
    if spec.arch == "gpt":
        return activation_bytes_per_layer(seq_local, layout.micro_batch, spec.hidden, spec.heads, **kw) * elem / 2
    dense = llama_activation_bytes_per_layer(seq_local, layout.micro_batch, spec.hidden, spec.heads,
                                             spec.kv_heads, spec.ffn, elem_bytes=elem, **kw)
    if spec.experts == 1 or layout.recompute == "full":
        return dense
    # an MoE layer's FFN, per token: each of its k expert rows keeps the gathered input row, the SwiGLU's
    # four f-wide tensors and the returned output row (weighted by its gate), instead of the dense 4f;
    # the router keeps fp32 logits, probabilities and log-sum-exp inputs (3E)
    tokens = seq_local * layout.micro_batch
    moe = elem * spec.top_k * (4 * spec.ffn + 2 * spec.hidden) + 4 * 3 * spec.experts
    return dense + spec.moe_fraction * tokens * (moe - elem * 4 * spec.ffn) / layout.tp
