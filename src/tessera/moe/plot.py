"""A plot of expert load over training steps (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations


def plot_expert_load(steps: list[int], load_SLE: list[list[list[float]]], path: str, band: tuple[float, float],
                     title: str = "expert load") -> None:
    """One panel per MoE layer: each expert's load (tokens / uniform share) against the step, with the
    stated band shaded. ``load_SLE[step][layer][expert]`` as in ``moe_metrics()['moe_load_per_layer']``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_layers, n_exp = len(load_SLE[0]), len(load_SLE[0][0])
    fig, axes = plt.subplots(1, n_layers, figsize=(5 * n_layers, 3.6), sharey=True, squeeze=False)
    for layer, ax in enumerate(axes[0]):
        for e in range(n_exp):
            ax.plot(steps, [row[layer][e] for row in load_SLE], lw=1, label=f"expert {e}")
        ax.axhspan(band[0], band[1], color="grey", alpha=0.15, label=f"band [{band[0]}, {band[1]}]")
        ax.axhline(1.0, color="black", lw=0.6, ls="--")
        ax.set_title(f"{title}: MoE layer {layer}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("load / uniform share")
    axes[0][-1].legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
