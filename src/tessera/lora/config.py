"""The ``[lora]`` section: low-rank adapters on chosen linear layers (Hu et al., 2021).

``rank = 0`` (the default) trains every parameter as before. With ``rank = r > 0`` every linear layer
whose name (its last component) is in ``targets`` gains an adapter ``scale · B A x`` with ``A`` [r, in]
and ``B`` [out, r], ``scale = alpha / r``; every other parameter of the model is frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tessera.errors import ConfigError

# Linear layers of tessera's decoder an adapter may sit on: attention projections and the SwiGLU MLP's
# (also each expert's, in a mixture of experts). The router and the vocabulary head take none.
TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


@dataclass
class LoRAConfig:
    """Low-rank adapters (the ``[lora]`` config section)."""

    rank: int = 0  # r: 0 = no adapters (full training)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapter's input (training only)
    targets: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo"])
    # a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) whose values the adapters
    # start from instead of (A ~ N(0, 1/r²), B = 0); its rank, alpha and targets must be these
    init_from: str = ""

    def __post_init__(self):
        if self.init_from:  # absolute, so the run's config.toml works from anywhere
            self.init_from = str(Path(self.init_from).expanduser().resolve())

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> LoRAConfig:
        """Raise ConfigError (one sentence) for a setting that cannot work; return self."""
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"lora.rank must be a non-negative integer (0 = off), got {self.rank!r}.")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha must be positive, got {self.alpha!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout!r}.")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown:
            raise ConfigError(f"lora.targets has {', '.join(unknown)}, which name no linear layer; choose among "
                              f"{', '.join(TARGETS)}.")
        if self.enabled and not self.targets:
            raise ConfigError("lora.targets is empty, so lora.rank > 0 would train nothing.")
        if self.init_from and not self.enabled:
            raise ConfigError("lora.init_from gives the adapters' initial values, so it needs lora.rank > 0 "
                              "(the rank of that adapter).")
        if self.init_from:  # its adapter_config.json: an adapter tessera computes, of these settings
            from tessera.lora.peft import check_same_adapters, read_peft_config

            check_same_adapters(read_peft_config(self.init_from), self, self.init_from)
        return self
