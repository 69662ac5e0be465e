"""Communication volumes the tensor-parallel layers should record, from the algorithms' formulas.

Each function returns ``{op: payload bytes}`` as the CommLedger counts payload (the caller's tensor size;
for all-gather / reduce-scatter the full, gathered size). Legend: b batch, s sequence, h model dim,
T = b·s tokens, I/O in/out features, q grid side, d 2.5D depth, e bytes per element.
Tests compare the ledger to these; docs/TENSOR_PARALLEL.md prints both.
"""

from __future__ import annotations


def megatron_1d_layer(b: int, s: int, h: int, e: int = 4, sequence_parallel: bool = False,
                      backward: bool = False) -> dict:
    """One transformer layer's forward (or backward): 2 all-reduces of b·s·h (Megatron), or under SP
    2 all-gathers + 2 reduce-scatters of b·s·h (same wire bytes: an all-reduce is a reduce-scatter plus an
    all-gather). SP's backward all-gathers each region's input once more (only the slice was saved)."""
    act = b * s * h * e
    if sequence_parallel:
        return {"all_gather": (4 if backward else 2) * act, "reduce_scatter": 2 * act}
    return {"all_reduce": 2 * act}


def summa_linear(T: int, I: int, O: int, q: int, d: int = 1, e: int = 4) -> tuple[dict, dict]:
    """(forward, backward) of a 2D (d = 1) / 2.5D SUMMA linear: q steps, each broadcasting an activation
    block [T/(dq), I/q] along the row and a weight block [O/q, I/q] along the column; backward repeats the
    broadcasts and reduces the two products; 2.5D adds an all-reduce of the weight gradient over depth."""
    x_blk, w_blk = T // (d * q) * (I // q) * e, (O // q) * (I // q) * e
    fwd = {"broadcast": q * (x_blk + w_blk)}
    bwd = {"broadcast": q * (x_blk + w_blk), "reduce": q * (x_blk + w_blk)}
    if d > 1:
        bwd["all_reduce"] = w_blk
    return fwd, bwd


def cube_linear(T: int, I: int, O: int, q: int, e: int = 4) -> tuple[dict, dict]:
    """(forward, backward) of a 3D linear: all-gather input [T/q, I/q] and weight [O/q, I/q], reduce-scatter
    output [T/q, O/q]; backward all-gathers dy and reduce-scatters dx and dw."""
    x, w, y = T // q * (I // q) * e, O // q * (I // q) * e, T // q * (O // q) * e
    return {"all_gather": x + w, "reduce_scatter": y}, {"all_gather": y, "reduce_scatter": x + w}


def add(*volumes: dict) -> dict:
    out: dict = {}
    for v in volumes:
        for op, n in v.items():
            out[op] = out.get(op, 0) + n
    return out


def nd_block(mode: str, b: int, s: int, h: int, kv: int, ffn: int, q: int, d: int = 1, e: int = 4) -> tuple[dict, dict]:
    """(forward, backward) of a TransformerBlockND: 7 linears + 2 norms (kv = n_kv_heads·head_dim).

    Norm: all-reduce of the per-token sum of squares over the feature ranks (fwd and bwd); bwd also
    all-reduces the weight block over each replica group (2D: col and, for 2.5D, depth; 3D: x and y).
    """
    T = b * s
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, ffn), (h, ffn), (ffn, h)]
    if mode == "3d":
        lin = [cube_linear(T, i, o, q, e) for i, o in shapes]
        tokens, replicas = T // (q * q), 2
    else:
        lin = [summa_linear(T, i, o, q, d, e) for i, o in shapes]
        tokens, replicas = T // (d * q), 1 + (d > 1)
    norm_fwd = {"all_reduce": 2 * tokens * e}
    norm_bwd = {"all_reduce": 2 * tokens * e + 2 * replicas * (h // q) * e}
    return add(*[f for f, _ in lin], norm_fwd), add(*[g for _, g in lin], norm_bwd)
