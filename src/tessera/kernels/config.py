"""``[kernels]``: which implementation of a few hot operations a run uses. Every choice computes the same
mathematics; the defaults are the ones every parity test was measured with, the others are faster on some
devices (fused AdamW and compiled blocks on a GPU above all) and round differently.

    adamw           "auto" (torch's own choice: for-loop on CPU), "for-loop", "foreach", "fused": the
                    implementation of the optimizer step, whichever ``optim.name`` (AdamW, Adam, SGD, Adagrad)
    rms_norm        "reference" (tessera's fp32 formula) or "torch" (``F.rms_norm``)
    gqa             "repeat" (k/v heads repeated by hand before SDPA) or "sdpa" (SDPA's ``enable_gqa``)
    compile         false, or true: ``torch.compile`` of every transformer block
    compile_backend the ``torch.compile`` backend when ``compile`` is true ("inductor", "aot_eager", …)
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError

ADAMW = ("auto", "for-loop", "foreach", "fused")
RMS_NORM = ("reference", "torch")
GQA = ("repeat", "sdpa")


@dataclass
class KernelsConfig:
    adamw: str = "auto"
    rms_norm: str = "reference"
    gqa: str = "repeat"
    compile: bool = False
    compile_backend: str = "inductor"

    def validate(self) -> KernelsConfig:
        for key, value, allowed in (("adamw", self.adamw, ADAMW), ("rms_norm", self.rms_norm, RMS_NORM),
                                    ("gqa", self.gqa, GQA)):
            if value not in allowed:
                raise ConfigError(f"kernels.{key}={value!r} is unknown; use one of {', '.join(allowed)}")
        if not self.compile_backend:
            raise ConfigError("kernels.compile_backend must name a torch.compile backend, e.g. 'inductor'")
        if self.compile:
            _check_backend(self.compile_backend)
        return self


def _check_backend(name: str) -> None:
    """A backend torch does not know would fail at each rank's first compiled call; refuse it here."""
    from torch._dynamo import list_backends  # imported only when compiling: it takes seconds

    if name not in list_backends(exclude_tags=()):
        raise ConfigError(f"kernels.compile_backend={name!r} is not a torch.compile backend of this torch "
                          "(torch._dynamo.list_backends() names them); use e.g. 'inductor' or 'aot_eager'")
