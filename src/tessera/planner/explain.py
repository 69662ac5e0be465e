"""Presenting a plan: a ranked table for people, JSON for programs, and breakdowns of the top choices."""

from __future__ import annotations

import shlex

GB = 1e9


def as_json(est, band: tuple[float, float] = (1.0, 1.0)) -> dict:
    """The issue's per-layout record: layout, memory_bytes, step_time_s, tokens_per_s, mfu, bubble_fraction,
    and the uncertainty band of each time (``band``: multipliers of the step time, low and high,
    ``tessera.planner.published.step_band``)."""
    low, high = band
    return {
        "layout": est.layout.as_dict(),
        "memory_bytes": {k: int(round(v)) for k, v in est.memory_bytes.items()},
        "host_bytes": int(round(est.host_bytes)),
        "step_time_s": est.step_time_s,
        "time_breakdown_s": dict(est.time_s),
        "tokens_per_s": est.tokens_per_s,
        "mfu": est.mfu,
        "bubble_fraction": est.bubble_fraction,
        "step_time_s_band": [est.step_time_s * low, est.step_time_s * high],
        "tokens_per_s_band": [est.tokens_per_s / high, est.tokens_per_s / low],
        "mfu_band": list(mfu_band(est.mfu, band)),
    }


def mfu_band(mfu: float, band: tuple[float, float]) -> tuple[float, float]:
    """The MFU range of a step-time band (low, high multipliers): no step beats the peak."""
    low, high = band
    return mfu / high, min(1.0, mfu / low)


def table(estimates, gpus: int, band: tuple[float, float] = (1.0, 1.0)) -> str:
    """One line per layout, fastest first; the MFU with its band (``as_json``)."""
    head = (f"{'#':>3}  {'layout':<48}{'mem GB':>8}{'step s':>10}{'tok/s':>12}{'MFU':>7}"
            f"{'MFU band':>15}{'bubble':>8}")
    lines = [head, "-" * len(head)]
    for i, e in enumerate(estimates, 1):
        spread = "{:.1%}–{:.1%}".format(*mfu_band(e.mfu, band))
        lines.append(f"{i:>3}  {e.layout.describe():<48}{e.memory_bytes['total'] / GB:>8.1f}"
                     f"{e.step_time_s:>10.3f}{e.tokens_per_s:>12,.0f}{e.mfu:>7.1%}{spread:>15}{e.bubble_fraction:>8.1%}")
    return "\n".join(lines)


def breakdown(est) -> str:
    """Where the memory and the time of one layout go, largest first."""
    mem = ", ".join(f"{k} {v / GB:.2f}" for k, v in est.memory_bytes.items() if k != "total" and v)
    total = est.step_time_s
    parts = sorted(((v, k) for k, v in est.time_s.items() if v > 0), reverse=True)
    time = ", ".join(f"{k} {v:.3f}s ({v / total:.0%})" for v, k in parts)
    host = f"; host {est.host_bytes / GB:.2f} GB (offloaded optimizer)" if est.host_bytes else ""
    return (f"{est.layout.describe()}\n  memory GB/rank: {mem}; total {est.memory_bytes['total'] / GB:.2f}{host}\n"
            f"  time/step: {time}; total {total:.3f}s")


def train_flags(common: list, per_layout: list, gpus: int) -> str:
    """The ``tessera train`` command of each ranked layout: the flags they share, then each one's own."""
    launch = f"--nproc {gpus}" if gpus <= 8 else "under torchrun"
    lines = [f"train flags ({gpus} ranks: {launch}; the common flags, then a layout's own):",
             "tessera train " + shlex.join(common)]  # quoted where a shell needs it (a list's brackets)
    lines += [f"{f'#{i}':>5}  " + shlex.join(flags) for i, flags in enumerate(per_layout, 1)]
    return "\n".join(lines)


def explain(plan, gpus: int, top: int = 3, flags: tuple | None = None, band: tuple[float, float] = (1.0, 1.0),
            band_source: str = "") -> str:
    """The ranked table, the ``tessera train`` flags of each layout (``flags``: (common, per layout)) and
    the breakdowns of the first ``top`` choices. ``band``: the step-time multipliers of the uncertainty
    band, ``band_source`` where it comes from."""
    refused = f", {len(plan.refused)} faster ones refused by tessera train" if plan.refused else ""
    out = [table(plan.ranked, gpus, band), "",
           f"{plan.considered} layouts considered, {plan.fitting} fit{refused}, {len(plan.ranked)} shown."]
    if band_source:
        out.append(f"band: step time × {band[0]:.2f} … × {band[1]:.2f}, {band_source}")
    if flags is not None:
        out += ["", train_flags(*flags, gpus)]
    out += ["", "top choices:"] + [breakdown(e) for e in plan.ranked[:top]]
    return "\n".join(out)
