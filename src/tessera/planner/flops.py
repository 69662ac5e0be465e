"""FLOPs per iteration (Narayanan et al. 2021, eq. 3) and the pipeline bubble per schedule.

Bubble, as a fraction of the whole step: with p stages and m micro-batches, GPipe and 1F1B idle for
(p−1) micro-batch slots out of m + p − 1 (Narayanan et al. 2021 give (p−1)/m, the same bubble as a
fraction of the *ideal* time); interleaving v model chunks per stage shrinks the bubble v-fold, to
(p−1)/v slots; ZB-H1 (Qi et al. 2023) splits the backward into input- and weight-gradient halves and
fills about two thirds of 1F1B's bubble, leaving (p−1)/3 slots.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def flops_per_iteration(global_batch: int, seq: int, layers: int, hidden: int, vocab: int, *,
                        recompute: bool = True) -> float:
    """Narayanan et al. 2021, eq. 3: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full activation recompute
    (an extra forward of every layer, not of the logit layer); without it 72·B·s·l·h²·(1 + s/(6h) +
    V/(12·l·h)). B global batch in sequences, s sequence, l layers, h hidden, V vocabulary."""
    b, s, l, h, v = global_batch, seq, layers, hidden, vocab
    if recompute:
        return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    return 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Fraction of the total step time a pipeline stage sits idle (0 when pp == 1)."""
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError("pp, microbatches and virtual_stages must be at least 1")
    if pp == 1:
        return 0.0
    idle = {"gpipe": pp - 1.0, "1f1b": pp - 1.0, "interleaved": (pp - 1.0) / virtual_stages,
            "zb-h1": (pp - 1.0) / 3.0}
    if schedule not in idle:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    return idle[schedule] / (microbatches + idle[schedule])


def model_flops(spec, tokens: float, seq: int) -> float:
    """Training FLOPs the model needs for ``tokens`` tokens (no recomputation): 6 per matmul weight per
    token plus attention's score and value matmuls, 12·l·h·s per token (counted without the causal
    saving, as Narayanan et al. do). For a GPT this equals eq. 3 without recomputation.

    LoRA (``spec.lora_rank`` > 0): a frozen weight needs no weight gradient, only the input gradient the
    layers below it need: 4 per frozen matmul weight; each adapter weight a token meets (every layer's,
    its top-k experts') costs 6, as any trainable one."""
    per_weight = 4.0 if spec.lora_rank else 6.0
    a_dense, a_expert = spec.adapter_layer_params()
    adapters = spec.layers * (a_dense + a_expert * spec.top_k / spec.experts)
    return tokens * (per_weight * spec.matmul_params_per_token() + 6.0 * adapters
                     + 12.0 * spec.layers * spec.hidden * seq)


def attention_flops(spec, tokens: float, seq: int, recompute: str = "none") -> float:
    """The part of :func:`model_flops` + :func:`recompute_flops` in attention's score and value matmuls:
    12·l·h·s per token, 4·l·h·s more when a recomputation re-runs the forward."""
    return tokens * (12.0 + (4.0 if recompute != "none" else 0.0)) * spec.layers * spec.hidden * seq


def recompute_flops(spec, tokens: float, seq: int, recompute: str) -> float:
    """Extra FLOPs re-running forwards: full re-runs every layer's forward (a third of its training
    FLOPs); selective re-runs attention's scores and values only (4·l·h·s per token)."""
    if recompute == "none":
        return 0.0
    attention_fwd = 4.0 * spec.layers * spec.hidden * seq
    if recompute == "selective":
        return tokens * attention_fwd
    layer_matmuls = spec.matmul_params_per_token() - spec.vocab * spec.hidden
    return tokens * (2.0 * layer_matmuls + attention_fwd)


def ring_scores(rows: int, heads: int, seq: int, cp: int) -> float:
    """Query-key scores one cp rank's ring attention computes per layer, forward (the backward recomputes
    as many): with L = seq/cp local tokens, the first step's whole L × L block (masked, not skipped) and
    cp − 1 half blocks of L × L/2 (tessera.context_parallel.ring_attention's zig-zag regions)."""
    local = seq // cp
    return rows * heads * local * local * (cp + 1) / 2.0
