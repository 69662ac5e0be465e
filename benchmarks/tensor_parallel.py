"""Tensor parallelism: activation memory (Korthikanti et al. 2022), CommLedger volumes, and step time of
tessera 1D TP (+SP) against DTensor ``parallelize_module`` — all in one invocation.

    python benchmarks/tensor_parallel.py               # everything; rewrites the tp sections of the docs
    python benchmarks/tensor_parallel.py --no-write --skip memory ledger --rounds 1 --steps 1 --warmup 1

Memory: saved activations per transformer layer, measured with ``MemoryLedger.track_activations`` as
(forward of a 3-layer model − forward of a 1-layer model) / 2, so embedding, head and loss cancel.
Attention runs on SDPA's math kernel with dropout on, so the softmax, its dropout mask and output are
materialised like in the paper's a·s² term. Speed: the same model and ranks, interleaved A B A B, the
same AdamW arguments on both sides; ratios as median (min–max) over rounds.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (DOCS, MIN_ROUNDS, ab_summary, bench_parser, interleaved_times, pool_manager,  # noqa: E402
                     provenance, replace_section, spread, token_batch)

from tessera.comm import CommLedger  # noqa: E402
from tessera.tensor_parallel.nd import Grid2D, Grid3D, Layout2D, Layout3D, TransformerBlockND  # noqa: E402
from tessera.models.layers import TransformerBlock, precompute_rope  # noqa: E402
from tessera.models import Transformer, model_config  # noqa: E402
from tessera.tensor_parallel import (TensorParallelConfig, TensorParallelLoss,  # noqa: E402
                                     apply_tensor_parallel, volumes)
from tessera.topology import ParallelConfig, Topology  # noqa: E402
from tessera.train.memory import MemoryLedger  # noqa: E402

BENCH_DOC, TP_DOC = DOCS / "BENCHMARKS.md", DOCS / "TENSOR_PARALLEL.md"
MEM_SHAPE = dict(dim=64, n_heads=4, n_kv_heads=4, ffn_hidden_dim=256, vocab_size=128, max_seq_len=64, dropout=0.1)
MEM_B, MEM_S = 2, 64


def _saved_bytes(model, tokens) -> int:
    ledger = MemoryLedger(model)
    with sdpa_kernel([SDPBackend.MATH]), ledger.track_activations():
        model(tokens)
    return ledger.activation_bytes


def memory_worker(rank, world_size):
    """Per-layer saved bytes for: no TP, TP, TP+SP, TP+SP+selective recompute (tp = world_size)."""
    topo = Topology.build(ParallelConfig(tp=world_size))
    try:
        tp = topo.group("tp")
        tokens = torch.randint(0, MEM_SHAPE["vocab_size"], (MEM_B, MEM_S), generator=torch.Generator().manual_seed(0))
        variants = {"none": None, "tp": TensorParallelConfig(),
                    "tp_sp": TensorParallelConfig(sequence_parallel=True),
                    "tp_sp_selective": TensorParallelConfig(sequence_parallel=True, recompute_core_attention=True),
                    "tp_selective": TensorParallelConfig(recompute_core_attention=True)}
        out = {}
        for name, cfg in variants.items():
            per = []
            for layers in (1, 3):
                torch.manual_seed(0)
                model = Transformer(model_config("tiny", n_layers=layers, **MEM_SHAPE)).train()
                if cfg is not None:
                    apply_tensor_parallel(model, tp, cfg)
                per.append(_saved_bytes(model, tokens))
            out[name] = (per[1] - per[0]) // 2
        return out
    finally:
        topo.destroy()


def korthikanti(s, b, h, a, t, bytes_per=2):
    """The paper's per-layer bytes (16-bit activations, GPT layer with 4h MLP): none, TP, TP+SP, +selective."""
    return {"none": s * b * h * (34 + 5 * a * s / h), "tp": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
            "tp_sp": s * b * h / t * (34 + 5 * a * s / h), "tp_sp_selective": s * b * h / t * 34,
            "tp_selective": s * b * h * (10 + 24 / t)}




# ---- CommLedger volumes ---------------------------------------------------------------------------

LED_B, LED_S = 4, 16
LED_SHAPE = dict(dim=32, n_heads=4, n_kv_heads=4, ffn_hidden_dim=64, vocab_size=96, max_seq_len=16)


def _ledger_phases(model, tp, ledger, tokens):
    before = ledger.stats()
    logits = model(tokens[:, :-1])
    fwd = ledger.since(before)
    s, n = TensorParallelLoss(tp)(logits, tokens[:, 1:])
    before = ledger.stats()
    (s / n).backward()
    bwd = ledger.since(before)
    return fwd, bwd


def _by_op(stats, axes=None):
    out = {}
    for (axis, op), st in stats.items():
        if axes is None or axis in axes:
            out[op] = out.get(op, 0) + st.bytes
    return out


def ledger_1d_worker(rank, world_size):
    """Per-layer tp bytes by op, forward and backward, with and without SP: (3 layers − 1 layer) / 2."""
    ledger = CommLedger()
    topo = Topology.build(ParallelConfig(tp=world_size), ledger)
    try:
        tp = topo.group("tp")
        tokens = torch.randint(0, 96, (LED_B, LED_S + 1), generator=torch.Generator().manual_seed(0))
        out = {}
        for sp in (False, True):
            runs = []
            for layers in (1, 3):
                torch.manual_seed(0)
                model = Transformer(model_config("tiny", n_layers=layers, **LED_SHAPE))
                apply_tensor_parallel(model, tp, TensorParallelConfig(sequence_parallel=sp))
                runs.append([_by_op(p, ("tp",)) for p in _ledger_phases(model, tp, ledger, tokens)])
            out[sp] = [{op: (big[op] - small.get(op, 0)) // 2 for op in big if big[op] != small.get(op, 0)}
                       for big, small in zip(runs[1], runs[0])]
        return out
    finally:
        topo.destroy()


def ledger_nd_worker(rank, world_size, mode, depth):
    ledger = CommLedger()
    topo = Topology.build(ParallelConfig(tp=world_size), ledger)
    try:
        tp, part = topo.group("tp"), topo.partitions["tp"]
        grid = Grid3D.build(tp, part) if mode == "3d" else Grid2D.build(tp, part, depth)
        layout = Layout3D(grid) if mode == "3d" else Layout2D(grid)
        cfg = model_config("tiny", **LED_SHAPE)
        torch.manual_seed(0)
        block = TransformerBlockND(TransformerBlock(cfg), layout)
        x = layout.shard(torch.randn(LED_B, LED_S, cfg.dim, generator=torch.Generator().manual_seed(1)))
        cos, sin = precompute_rope(cfg.head_dim, LED_S)
        before = ledger.stats()
        y = block(x.requires_grad_(), cos, sin)
        fwd = ledger.since(before)
        before = ledger.stats()
        y.sum().backward()
        return [_by_op(fwd), _by_op(ledger.since(before))]
    finally:
        topo.destroy()


# ---- step time against DTensor ---------------------------------------------------------------------


def _dtensor_model(cfg, mesh, sp):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    torch.manual_seed(0)
    model = Transformer(cfg)
    seq_or_rep = Shard(1) if sp else Replicate()
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_or_rep),
            "output": ColwiseParallel(input_layouts=seq_or_rep, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        plan["norm"] = SequenceParallel()
    for name, block in model.layers.items():
        block.attention.n_heads //= mesh.size()
        block.attention.n_kv_heads //= mesh.size()
        p = f"layers.{name}."
        plan.update({
            p + "attention": PrepareModuleInput(input_layouts=(seq_or_rep, None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
            p + "attention.wq": ColwiseParallel(), p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(), p + "attention.wo": RowwiseParallel(output_layouts=seq_or_rep),
            p + "feed_forward": PrepareModuleInput(input_layouts=(seq_or_rep,), desired_input_layouts=(Replicate(),)),
            p + "feed_forward.w1": ColwiseParallel(), p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=seq_or_rep),
        })
        if sp:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
    return parallelize_module(model, mesh, plan)


def _step(kind, model, opt, x, y, tp) -> float:
    t0 = time.perf_counter()
    logits = model(x)
    if kind == "dtensor":
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
    else:
        s, n = TensorParallelLoss(tp)(logits, y)
        (s / n).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


@torch.no_grad()
def _loss(kind, model, x, y, tp) -> float:
    """The first batch's loss: both implementations must agree before their times mean anything."""
    logits = model(x)
    if kind == "dtensor":
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).full_tensor())
    s, n = TensorParallelLoss(tp)(logits, y)
    return float(s) / n


def speed_worker(rank, world_size, preset, batch, seq, rounds, steps, warmup):
    topo = Topology.build(ParallelConfig(tp=world_size))
    try:
        tp, mesh = topo.group("tp"), topo.device_mesh("cpu")
        cfg = model_config(preset)
        models = {}
        for sp in (False, True):
            torch.manual_seed(0)
            ours = apply_tensor_parallel(Transformer(cfg), tp, TensorParallelConfig(sequence_parallel=sp))
            theirs = _dtensor_model(cfg, mesh, sp)
            models[("tessera", sp)] = (ours, torch.optim.AdamW(ours.parameters(), lr=1e-4, foreach=False))
            models[("dtensor", sp)] = (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-4, foreach=False))
        x, y = token_batch(0, batch, seq, cfg.vocab_size)
        loss = {f"{k}/{'sp' if sp else 'tp'}": _loss(k, m, x, y, tp) for (k, sp), (m, _) in models.items()}
        steppers = {f"{kind}/{'sp' if sp else 'tp'}": partial(_step, kind, model, opt, x, y, tp)
                    for (kind, sp), (model, opt) in models.items()}
        return {**interleaved_times(steppers, rounds, warmup, steps), "loss": loss}  # A B A B within every round
    finally:
        topo.destroy()


# ---- reporting ---------------------------------------------------------------------------------------


def memory_table(pools) -> str:
    h, a = MEM_SHAPE["dim"], MEM_SHAPE["n_heads"]
    sbh = MEM_S * MEM_B * h
    rows = ["| t | variant | measured bytes/layer | measured / sbh | paper (16-bit GPT) / sbh | measured / none | paper / none |",
            "|---|---|---|---|---|---|---|"]
    measured = {}
    for t in (2, 4):
        m = measured[t] = pools.run(memory_worker, t, timeout=1800.0)[0]
        k = korthikanti(MEM_S, MEM_B, h, a, t)
        for name in ("none", "tp", "tp_sp", "tp_selective", "tp_sp_selective"):
            rows.append(f"| {t} | {name} | {m[name]} | {m[name] / sbh:.2f} | {k[name] / sbh:.2f} | "
                        f"{m[name] / m['none']:.3f} | {k[name] / k['none']:.3f} |")
    # This layer's constants in the paper's form sbh(R + P/t + A·as/(ht)): A from what selective
    # recomputation removes, P and R from TP at t = 2 and 4.
    m2, m4 = measured[2], measured[4]
    attn = (m2["tp_sp"] - m2["tp_sp_selective"]) * 2 / (sbh * a * MEM_S / h)
    p = (m2["tp"] - m4["tp"] - (m2["tp_sp"] - m2["tp_sp_selective"]) / 2) / (sbh * (1 / 2 - 1 / 4))
    r = m2["tp"] / sbh - p / 2 - attn * a * MEM_S / h / 2
    fit = (f"\n\nFrom these rows, this layer (fp32) is sbh({r:.2f} + {p:.2f}/t + {attn:.2f}·as/(ht)) bytes under TP "
           f"(the paper: sbh(10 + 24/t + 5as/(ht)) in 16-bit); without TP sbh({r + p:.2f} + {attn:.2f}·as/h) "
           f"(paper: sbh(34 + 5as/h)); check: none = {m2['none'] / sbh:.2f}·sbh, "
           f"formula = {r + p + attn * a * MEM_S / h:.2f}·sbh.")
    return (f"{provenance()} Model: tiny preset with "
            f"h={h}, a={a} heads (kv {MEM_SHAPE['n_kv_heads']}), SwiGLU F={MEM_SHAPE['ffn_hidden_dim']}, fp32, "
            f"dropout {MEM_SHAPE['dropout']}, SDPA math kernel; b={MEM_B}, s={MEM_S}; as/h = {a * MEM_S / h:g}. "
            "Per layer = (saved bytes of a 3-layer forward − a 1-layer forward) / 2, from "
            "`MemoryLedger.track_activations`, rank 0.\n\n" + "\n".join(rows) + fit)


def ledger_tables(pools) -> str:
    b, s, h = LED_B, LED_S, LED_SHAPE["dim"]
    lines = [f"{provenance()} CommLedger payload bytes per rank, fp32 (byte counts do not depend on the "
             "machine). "
             f"1D: tiny model h={h}, b={b}, s={s} (b·s·h·4 = {b * s * h * 4} bytes), per layer per micro-batch "
             "= (3-layer − 1-layer) / 2.", "",
             "| scheme | t | phase | measured (op: bytes) | formula (op: bytes) |", "|---|---|---|---|---|"]
    for t in (2, 4):
        out = pools.run(ledger_1d_worker, t, timeout=1800.0)[0]
        for sp in (False, True):
            for phase, got in zip(("fwd", "bwd"), out[sp]):
                want = volumes.megatron_1d_layer(b, s, h, sequence_parallel=sp, backward=phase == "bwd")
                if sp and phase == "bwd":
                    want["all_reduce"] = 2 * h * 4  # the two norm weights' gradients
                lines.append(f"| {'1D+SP' if sp else '1D'} | {t} | {phase} | {got} | {want} |")
    kv = LED_SHAPE["n_kv_heads"] * h // LED_SHAPE["n_heads"]
    lines += ["", f"2D / 2.5D / 3D: one TransformerBlockND (7 linears + 2 norms), h={h}, kv={kv}, "
              f"F={LED_SHAPE['ffn_hidden_dim']}, b={b}, s={s}; all tp sub-axes summed.", "",
              "| scheme | ranks | phase | measured (op: bytes) | formula (op: bytes) |", "|---|---|---|---|---|"]
    for mode, world, q, d in (("2d", 4, 2, 1), ("2.5d", 8, 2, 2), ("3d", 8, 2, 1)):
        got = pools.run(ledger_nd_worker, world, timeout=1800.0, mode=mode, depth=d)[0]
        want = volumes.nd_block(mode, b, s, h, kv, LED_SHAPE["ffn_hidden_dim"], q, d)
        for phase, g, w in zip(("fwd", "bwd"), got, want):
            lines.append(f"| {mode} | {world} | {phase} | {dict(sorted(g.items()))} | {dict(sorted(w.items()))} |")
    return "\n".join(lines)


def speed_section(pools, args) -> str:
    rows = ["| ranks | mode | tessera step (s) | DTensor step (s) | ratio tessera/DTensor |", "|---|---|---|---|---|"]
    for world in args.ranks:
        times = pools.run(speed_worker, world, timeout=3600.0, preset=args.preset, batch=args.batch, seq=args.seq,
                          rounds=args.rounds, steps=args.steps, warmup=args.warmup)
        losses = times[0]["loss"]
        gap = max(losses.values()) - min(losses.values())
        if gap > 1e-4:
            raise RuntimeError(f"tessera and DTensor disagree on the first loss: {losses}")
        print(f"first-batch losses agree within {gap:.1e}: {losses}", flush=True)
        for mode in ("tp", "sp"):
            s = ab_summary(times, f"tessera/{mode}", f"dtensor/{mode}")  # per round, the slowest rank's median
            ours, theirs, ratios = s[f"tessera/{mode}"], s[f"dtensor/{mode}"], s["ratio"]
            rows.append(f"| {world} | {'1D TP' if mode == 'tp' else '1D TP + SP'} | {statistics.median(ours):.4f} | "
                        f"{statistics.median(theirs):.4f} | **{spread(ratios)}** |")
            print(rows[-1], flush=True)
    params = model_config(args.preset).num_params()
    return (f"{provenance()} Model: "
            f"`{args.preset}` preset ({params / 1e6:.2f}M parameters), batch {args.batch}×{args.seq} tokens "
            "(the same on every tp rank), AdamW (lr 1e-4, foreach off, on both sides); step = forward + "
            "vocab-parallel loss + backward + update. "
            "Baseline: DTensor `parallelize_module` with ColwiseParallel / RowwiseParallel (+ SequenceParallel "
            "norms and Shard(1) activations for SP), `loss_parallel`, torchtitan's plan. "
            f"{args.rounds} interleaved rounds of {args.warmup} warm-up + {args.steps} timed steps per variant. "
            "Step = the slowest rank's median step in a round, then the median over rounds; ratio = per round "
            "tessera / DTensor, shown as median (min–max over rounds). Target ≤ 1.00. "
            "Before timing, the script checks that all four models give the same first-batch loss.\n\n"
            + "\n".join(rows))


def main() -> None:
    parser = bench_parser(__doc__, ranks=[2], preset="small", batch=8, seq=128, rounds=MIN_ROUNDS, steps=3, warmup=1,
                          no_write_help="print only; leave the docs alone")
    parser.add_argument("--skip", nargs="*", default=[], choices=["memory", "ledger", "speed"])
    args = parser.parse_args()
    sections = {}
    with pool_manager() as pools:
        if "memory" not in args.skip:
            sections["tp_memory"] = memory_table(pools)
        if "ledger" not in args.skip:
            sections["tp_ledger"] = ledger_tables(pools)
        if "speed" not in args.skip:
            sections["tensor_parallel"] = speed_section(pools, args)
    for name, body in sections.items():
        print(f"--- {name}\n{body}\n")
        if args.no_write:
            continue
        if name == "tensor_parallel":
            replace_section(BENCH_DOC, name, "Tensor parallel: tessera 1D TP (+SP) vs DTensor (CPU, gloo)", [body])
        else:
            replace_section(TP_DOC, name, "Measured", [body])


if __name__ == "__main__":
    main()
