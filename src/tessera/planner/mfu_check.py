"""The planner's MFU for Llama 3 8B against what torchtitan measured (``tessera plan --validate`` prints it).

torchtitan states 33–39 % MFU for its Llama 3.1 8B FSDP runs, counted against the H100 SXM's dense bf16
peak (989 TFLOP/s), and notes that its GPUs (Grand Teton: 96 GB HBM2e, 500 W) have a lower, unknown peak
(its performance page, footnote 2). So two questions are checked, in one unit — model FLOPs per token as
the planner counts them, which is torchtitan's count to within 1 %:

- on torchtitan's hardware (the catalogue's ``h100-hbm2e``), is the MFU of the layout ``tessera plan``
  picks at least torchtitan's best measured one (the planner may choose any layout, torchtitan's too) and
  no more than it times the band's largest error (else the planner promises more than such a GPU gives)?
- on an SXM H100 (``h100``, what ``tessera plan --gpu h100`` means), how does the pick's MFU against its
  own peak compare with the same on ``h100-hbm2e``? The GPUs differ in peak and HBM bandwidth, and MFU
  divides out the peak, so the two should differ by what the bandwidth changes only.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.planner.catalog import get_gpu, get_model
from tessera.planner.flops import model_flops

MODEL, GPUS, BATCH = "llama3-8b", 64, 512
SXM = "h100"  # the peak torchtitan divides by


@dataclass(frozen=True)
class Pick:
    gpu: str
    layout: str
    tokens_per_gpu: float
    mfu_own: float  # against the GPU's own peak
    mfu_sxm: float  # against the SXM peak, torchtitan's denominator


def _flops_per_token(seq: int) -> float:
    return model_flops(get_model(MODEL, seq=seq), 1, seq)


def pick(gpu_name: str) -> Pick:
    """The first layout ``tessera plan --model llama3-8b --gpus 64 --gpu GPU`` prints."""
    from tessera.planner.search import search
    from tessera.planner.trainable import TrainerRule, job_flags

    spec, gpu = get_model(MODEL), get_gpu(gpu_name)
    rule = TrainerRule(job_flags(spec, BATCH, spec.seq, "mixed"), BATCH)
    best = search(spec, gpu, GPUS, BATCH, spec.seq, precision="mixed", top=1, rule=rule).ranked[0]
    tokens = best.tokens_per_s / GPUS
    per_token = _flops_per_token(spec.seq)
    return Pick(gpu.name, best.layout.describe(), tokens, tokens * per_token / gpu.peak_flops,
                tokens * per_token / get_gpu(SXM).peak_flops)


def torchtitan_mfus() -> list[tuple[str, float, float, float, float]]:
    """(run, published and predicted tokens/s per GPU, published MFU against the SXM peak, the planner's
    prediction on that layout in the same unit)."""
    from tessera.planner.published import checks, load_runs

    runs = {run["name"]: run for run in load_runs()}
    sxm = get_gpu(SXM).peak_flops
    out = []
    for c in checks():
        run = runs[c.name]
        if run["group"] != "torchtitan":
            continue
        per_token = _flops_per_token(run["seq"])
        out.append((c.name, c.published, c.predicted, c.published * per_token / sxm, c.predicted * per_token / sxm))
    return out


def consistent(hbm2e: Pick, measured_best: float, largest_error: float) -> bool:
    """The pick on torchtitan's GPUs lies between torchtitan's best MFU and that MFU times the band's top."""
    return measured_best <= hbm2e.mfu_sxm <= measured_best * (1.0 + largest_error)


def report() -> str:
    """Markdown: torchtitan's runs, the planner's picks on both H100s, and the verdict."""
    from tessera.planner.published import band

    rows = torchtitan_mfus()
    hbm2e, sxm = pick("h100-hbm2e"), pick(SXM)
    best = max(row[3] for row in rows)
    ok = consistent(hbm2e, best, band()[1])
    lines = ["| Llama 3 8B | GPU | tokens/s/GPU | MFU vs 989 TFLOP/s (torchtitan's unit) | MFU vs the GPU's peak |",
             "|---|---|---:|---:|---:|"]
    own = get_gpu("h100-hbm2e").peak_flops / get_gpu(SXM).peak_flops
    for name, tokens, tokens_predicted, published, predicted in rows:
        lines.append(f"| {name}: published / predicted | h100-hbm2e | {tokens:,.0f} / {tokens_predicted:,.0f} | "
                     f"{published:.1%} / {predicted:.1%} | "
                     f"{published / own:.1%} / {predicted / own:.1%} |")
    for p in (hbm2e, sxm):
        lines.append(f"| *tessera plan --model {MODEL} --gpus {GPUS} --gpu {p.gpu}*: {p.layout} | {p.gpu} | "
                     f"{p.tokens_per_gpu:,.0f} | {p.mfu_sxm:.1%} | {p.mfu_own:.1%} |")
    verdict = "consistent" if ok else "NOT consistent"
    lines.append(f"\nOn torchtitan's GPUs the planner's pick reaches {hbm2e.mfu_sxm:.1%} in torchtitan's unit: "
                 f"{verdict} with its best measured {best:.1%} (at least that, at most {best * (1 + band()[1]):.1%}, "
                 f"the band's largest error above it). On an SXM H100 the pick's MFU against its own peak is "
                 f"{sxm.mfu_own:.1%}, against {hbm2e.mfu_own:.1%} on h100-hbm2e: MFU divides out the peak, and "
                 f"the SXM's faster HBM moves the rest.")
    return "\n".join(lines)
