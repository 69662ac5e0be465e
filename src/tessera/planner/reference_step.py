"""The reference step's single-thread pieces, and the timer that runs them in turn.

The calibration (tessera.planner.calibrate) charges a step as matmuls + attention + a fixed cost per layer
and micro-batch + the optimizer update + the rest (the non-matmul kernels), and finds the rest as what is
left of a whole step once the others are taken out. Timed one after the other, a few seconds each, the
pieces saw a shared machine at different speeds (here the fastest matmul rate of three calibrations two
minutes apart ranged 57–79 GFLOP/s), and a difference of two rates measured at different speeds is mostly
the change of speed: the rest came out 0 in two of those three. :func:`timed_rounds` runs every piece once
per round, round after round: each piece's fastest round gives its rate, and the rest is taken within each
round, between pieces timed less than a second apart (tessera.planner.calibrate.elementwise_from_rounds).

Each piece is a ``(run, work)`` pair: ``run()`` does one pass, ``work`` is what the pass counts (FLOPs or
bytes); timing is in the thread's CPU time, one thread (as a rank runs), so that other processes do not
slow it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch

from tessera.planner.flops import ring_scores

# the reference step: tessera's `small` preset, 4 sequences of 128 tokens; its matmuls are [512, 256] by
# [256, n] for n = 256 (wq, wo, head), 128 (wk, wv), 688 (w1, w3) and the [512, 688] by [688, 256] of w2
REFERENCE = ("small", 4, 128)
LAYER_MATMULS = ((256, 256), (256, 256), (256, 128), (256, 128), (256, 688), (256, 688), (688, 256))
SPLITS = 4  # micro-batches of the accumulated pass that layer_call_s compares with one


@contextlib.contextmanager
def one_thread(threads: int = 1):
    """torch on ``threads`` threads (one rank's share of the CPU) inside, as before outside."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed_rounds(pieces: dict[str, Callable[[], object]], seconds: float,
                 min_rounds: int = 1) -> dict[str, list[float]]:
    """CPU seconds of each pass of each piece: every piece runs once per round, in turn, for at least
    ``min_rounds`` rounds and ``seconds`` of wall time; the first round only warms up (and is left out)
    when more than one is asked for."""
    times: dict[str, list[float]] = {name: [] for name in pieces}
    rounds, start = 0, time.perf_counter()
    while rounds < min_rounds or time.perf_counter() - start < seconds:
        for name, run in pieces.items():
            t0 = time.thread_time()
            run()
            elapsed = time.thread_time() - t0
            if rounds > 0 or min_rounds == 1:
                times[name].append(elapsed)
        rounds += 1
    return times


def fastest(pieces: dict[str, Callable[[], object]], seconds: float, min_rounds: int = 1) -> dict[str, float]:
    """Fastest CPU seconds of one pass of each piece (:func:`timed_rounds`)."""
    return {name: min(times) for name, times in timed_rounds(pieces, seconds, min_rounds).items()}


def layer_matmuls(tokens: int = 512, dtype=torch.float32):
    """The reference layer's matmuls as training runs them (forward y = x·Wᵀ, backward dx = dy·W and
    dW = dyᵀ·x) on ``tokens`` rows: (run, FLOPs)."""
    mats = [tuple(torch.randn(*shape, dtype=dtype) for shape in ((tokens, k), (n, k), (tokens, n)))
            for k, n in LAYER_MATMULS]

    def run():
        for x, w, dy in mats:
            x @ w.t(), dy @ w, dy.t() @ x

    return run, sum(6 * tokens * k * n for k, n in LAYER_MATMULS)


def attention(rows: int = 4, seq: int = 128):
    """The reference layer's causal attention, forward and backward, through the model's SDPA (q [rows,
    seq, 8, 32] over k, v [rows, seq, 4, 32]; the reference step's is 4 × 128): (run, FLOPs as the
    planner counts them, 12·h·s per token with no causal saving). Its matmuls are [seq, 32]-thin, so they
    run well below the layer matmuls' rate."""
    from tessera.models import model_config
    from tessera.models.layers import causal_sdpa

    cfg = model_config(REFERENCE[0])
    e = cfg.head_dim
    q = torch.randn(rows, seq, cfg.n_heads, e, requires_grad=True)
    k, v = (torch.randn(rows, seq, cfg.n_kv_heads, e, requires_grad=True) for _ in range(2))
    return lambda: causal_sdpa(q, k, v).sum().backward(), 12.0 * cfg.dim * seq * rows * seq


ATTENTION_LENGTHS = ((16, 32), (4, 128), (1, 384))  # (sequences, tokens each) of the attention passes


def attention_fit(passes: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(FLOP/s, seconds per token and head) of attention from passes of the reference layer's attention at
    several sequence lengths, as (sequences, tokens each, seconds): per token and query head a pass costs
    12·e·s FLOPs at the rate plus a fixed per-row cost, a straight line in s fitted by least squares (one
    length alone cannot tell the two apart; the reference's 128 tokens ran at ~31 GFLOP/s where 512 ran
    at ~43). A line that does not rise with s (disturbed passes) leaves the FLOPs alone at their mean rate;
    one that would cost less than nothing per row, the line through 0."""
    from tessera.models import model_config

    cfg = model_config(REFERENCE[0])
    x = [12.0 * cfg.head_dim * seq for _, seq, _ in passes]  # FLOPs per token and head
    y = [t / (rows * seq * cfg.n_heads) for rows, seq, t in passes]  # seconds per token and head
    mx, my = sum(x) / len(x), sum(y) / len(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    if slope > 0 and my - slope * mx >= 0:
        return 1.0 / slope, my - slope * mx
    if slope <= 0:
        return mx / my, 0.0
    return sum(a * a for a in x) / sum(a * b for a, b in zip(x, y)), 0.0


RING = (4, 128, 2)  # (sequences, tokens each, cp) of the ring-attention passes: the reference step's batch on cp = 2


def ring_attention_blocks(rows: int = RING[0], seq: int = RING[1], cp: int = RING[2]):
    """One cp rank's ring-attention kernels for the reference layer, without the ring: the blockwise
    forward and backward (tessera.context_parallel.blockwise) of every step's block, in float32 as they
    run. Returns ((forward run, backward run), scores per pass, head dim). They materialize each block's
    scores and run softmax, masking and the online merge as separate kernels over them: per score about
    twice a fused SDPA's time on one CPU thread, whatever the FLOPs."""
    import math

    from tessera.context_parallel.blockwise import block_backward, block_forward
    from tessera.models import model_config

    cfg = model_config(REFERENCE[0])
    e, local = cfg.head_dim, seq // cp
    q, dout = (torch.randn(rows, cfg.n_heads, local, e) for _ in range(2))
    k, v = (torch.randn(rows, cfg.n_kv_heads, local, e) for _ in range(2))
    scale = 1.0 / math.sqrt(e)
    late = slice(local // 2, None)  # the half block: the late query chunk against all keys (src > rank)
    blocks = [(slice(None), True)] + [(late, False)] * (cp - 1)
    out, lse = block_forward(q, k, v, scale, True)
    delta = (dout * out).sum(-1)

    def forward():
        for qs, causal in blocks:
            block_forward(q[:, :, qs], k, v, scale, causal)

    def backward():
        for qs, causal in blocks:
            block_backward(q[:, :, qs], k, v, dout[:, :, qs], lse[:, :, qs], delta[:, :, qs], scale, causal)

    return (forward, backward), ring_scores(rows, cfg.n_heads, seq, cp), e


def ring_rates(forward_s: float, backward_s: float, scores: float, head_dim: int,
               attention_rate: float) -> tuple[float, float]:
    """(forward, backward) seconds per score beyond the blocks' matmul FLOPs at ``attention_rate``: 4e
    per score forward (q·kᵀ, p·v), 10e backward (q·kᵀ again, dv, dp, dq, dk); never below 0."""
    return (max(0.0, forward_s / scores - 4.0 * head_dim / attention_rate),
            max(0.0, backward_s / scores - 10.0 * head_dim / attention_rate))


def _model(preset: str):
    from tessera.models import Transformer, model_config

    cfg = model_config(preset)
    torch.manual_seed(0)
    return cfg, Transformer(cfg)


def training_step(preset: str = "small", rows: int = 4, seq: int = 128):
    """One AdamW training step of ``preset`` on ``rows`` × ``seq`` tokens: (run, model FLOPs)."""
    from tessera.models import cross_entropy_sum

    cfg, model = _model(preset)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (rows, seq))

    def run():
        s, n = cross_entropy_sum(model(x), x)
        (s / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run, cfg.flops_per_token(seq) * rows * seq


def accumulated_passes(splits: int):
    """Forward and backward of the reference batch as ``splits`` micro-batches (gradient accumulation),
    no update: (run, passes through a layer beyond one micro-batch's, the embedding and head counted as
    one more layer)."""
    from tessera.models import cross_entropy_sum

    preset, rows, seq = REFERENCE
    cfg, model = _model(preset)
    x = torch.randint(0, cfg.vocab_size, (rows, seq))

    def run():
        for part in x.chunk(splits):
            s, _ = cross_entropy_sum(model(part), part)
            s.backward()
        model.zero_grad(set_to_none=True)

    return run, (splits - 1) * (cfg.n_layers + 1)


def update(preset: str = "small"):
    """One torch AdamW update of ``preset`` (gradients given, moments made): (run, bytes in the time
    model's unit, 2 × the fp32 model-state bytes: every state read and written once). Timed, not assumed:
    left at a fixed 10 GB/s, an update that ran about 2× slower went into the non-matmul rate at the
    reference shape and was charged by activation bytes elsewhere."""
    from tessera.planner.catalog import from_model_config
    from tessera.planner.memory import model_state_bytes

    cfg, model = _model(preset)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()  # creates the moments
    params = from_model_config(preset, cfg).num_params()
    return opt.step, 2 * model_state_bytes(params, zero_stage=0, dp=1, precision="fp32")["total"]


def rates(seconds: float = 5.0, min_rounds: int = 6) -> tuple[dict, list[dict]]:
    """The single-thread rates of the reference step, every piece timed in the same rounds: (the rates at
    the fastest step's speed, each round's own), each a dict of ``peak_flops`` (layer matmuls),
    ``attention_rate`` and ``attention_row_s`` (:func:`attention_fit`), ``ring_forward_s`` and
    ``ring_backward_s`` (:func:`ring_rates` of :func:`ring_attention_blocks`), ``step_flops_alone`` (a whole
    training step), ``layer_call_s`` (one micro-batch's fixed cost per layer: the accumulated pass's
    extra seconds over its extra layer passes) and ``hbm_bytes_per_s`` (the optimizer update). The first:
    each piece's seconds as the median over rounds of its share of the round's step, times the fastest
    step, so that every piece is taken at one speed."""
    preset, rows, seq = REFERENCE
    with one_thread():
        (ring_fwd, ring_bwd), scores, head_dim = ring_attention_blocks()
        pieces = {"matmuls": layer_matmuls(), **{f"attention_{s}": attention(b, s) for b, s in ATTENTION_LENGTHS},
                  "ring_forward": (ring_fwd, scores), "ring_backward": (ring_bwd, scores),
                  "step": training_step(preset, rows, seq), "one": accumulated_passes(1),
                  "split": accumulated_passes(SPLITS), "update": update(preset)}
        times = timed_rounds({name: run for name, (run, _) in pieces.items()}, seconds, min_rounds)
    work = {name: w for name, (_, w) in pieces.items()}
    rounds = [{name: times[name][r] for name in times} for r in range(len(times["step"]))]
    for t in rounds:  # the fixed cost: what splitting the batch added, this round
        t["calls"] = max(0.0, t.pop("split") - t.pop("one"))

    def of(t: dict) -> dict:
        passes = [(b, s, t[f"attention_{s}"]) for b, s in ATTENTION_LENGTHS]
        attention_rate, attention_row_s = attention_fit(passes)
        ring = ring_rates(t["ring_forward"], t["ring_backward"], scores, head_dim, attention_rate)
        return {"peak_flops": work["matmuls"] / t["matmuls"], "attention_rate": attention_rate,
                "attention_row_s": attention_row_s, "ring_forward_s": ring[0], "ring_backward_s": ring[1],
                "step_flops_alone": work["step"] / t["step"],
                "layer_call_s": t["calls"] / work["split"], "hbm_bytes_per_s": work["update"] / t["update"]}

    step = min(t["step"] for t in rounds)
    at_one_speed = {name: step * statistics.median_high([t[name] / t["step"] for t in rounds]) for name in rounds[0]}
    return of(at_one_speed), [of(t) for t in rounds]
