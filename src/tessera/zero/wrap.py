"""Which modules become ZeRO-3 / FSDP units: auto-wrap policies and manual ``wrap()``.

A policy is a callable ``policy(module, unwrapped_params) -> bool`` asked for every module below the
root, children first; ``unwrapped_params`` counts the parameters of the module not already in a unit
below it. The root is always a unit (it takes whatever no other unit took).

    size_policy(min_params)       a module whose not-yet-wrapped parameters number at least min_params
                                  (torch FSDP's default_auto_wrap_policy, seed 001)
    class_policy(TransformerBlock) every instance of the given classes (torchtitan's per-block units)
    manual: inside ``with enable_wrap(**settings):`` ``wrap(module)`` marks module as a unit (with
            per-unit settings such as reshard_after_forward); outside the context wrap() does nothing.
    config_policy(root, paths, classes)  manual wrapping from the configuration (``zero.wrap_policy =
                                  "manual"`` with ``zero.wrap_paths`` / ``zero.wrap_classes``): the modules
                                  at those paths ("layers.*", "output") or of those classes are the units
                                  (:func:`selects`); ``tessera.train.wrap_check`` refuses before launch an entry
                                  that matches nothing in the model as the job runs it (LoRA, tp, ep applied).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from torch import nn

from tessera.errors import ConfigError

_MARK = "_tessera_zero_unit"
_settings: list[dict] = []  # stack of enable_wrap() settings; empty outside any context

Policy = Callable[[nn.Module, int], bool]


@contextlib.contextmanager
def enable_wrap(**settings):
    """Inside, ``wrap(module)`` marks modules as units carrying ``settings``."""
    _settings.append(dict(settings))
    try:
        yield
    finally:
        _settings.pop()


def wrap(module: nn.Module, **overrides) -> nn.Module:
    """Mark ``module`` as a unit when inside ``enable_wrap()``; returns the module itself."""
    if _settings:
        setattr(module, _MARK, {**_settings[-1], **overrides})
    return module


def unit_settings(module: nn.Module) -> dict | None:
    """The settings ``wrap()`` attached to ``module``, or None if it was not wrapped by hand."""
    return getattr(module, _MARK, None)


def size_policy(min_params: int) -> Policy:
    return lambda module, unwrapped: unwrapped >= min_params


def class_policy(*classes: type) -> Policy:
    return lambda module, unwrapped: isinstance(module, classes)


def manual_policy(module: nn.Module, unwrapped: int) -> bool:
    return unit_settings(module) is not None


def select_units(root: nn.Module, policy: Policy) -> list[nn.Module]:
    """Unit modules in pre-order (root first), decided children first as the policies define."""
    chosen: set[int] = set()

    def visit(module: nn.Module) -> int:
        """Parameters of ``module`` not inside a chosen unit below it."""
        own = sum(p.numel() for p in module.parameters(recurse=False))
        below = sum(visit(child) for child in module.children())
        unwrapped = own + below
        if module is not root and unwrapped and policy(module, unwrapped):
            chosen.add(id(module))
            return 0
        return unwrapped

    visit(root)
    return [root] + [m for m in root.modules() if id(m) in chosen and m is not root]


# ---- manual wrapping from the configuration (``zero.wrap_paths`` / ``zero.wrap_classes``) ---------------

CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)  # never called: no forward hook
# LoRA's adapter factors (tessera.lora.layer.ADAPTER_PARTS): their layer reads their weights without calling
# them, so their forward never runs either.
FACTORS = ("lora_A", "lora_B")
# A tensor-parallel layer answers to the class name of the layer it replaces as well as to its own, so one
# zero.wrap_classes list means the same layers with and without tp: "Linear" names the Column/RowParallelLinear
# (and the vocab head, a ColumnParallelLinear) that replace nn.Linear, "Embedding" the vocab-parallel
# embedding, "RMSNorm" the sequence-parallel norm.
STANDS_FOR = {"ColumnParallelLinear": "Linear", "RowParallelLinear": "Linear",
              "VocabParallelEmbedding": "Embedding", "SequenceParallelRMSNorm": "RMSNorm"}


def path_matches(pattern: str, path: str) -> bool:
    """``pattern`` names ``path`` (a ``named_modules()`` name): the same dot-separated components, a
    ``*`` standing for any one component ("layers.*" matches "layers.3", not "layers.3.ffn")."""
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have))


def class_names(module: nn.Module) -> set[str]:
    """The names ``module`` answers to in zero.wrap_classes: its class and every base class below
    nn.Module (LoRALinear is also a "Linear"), plus :data:`STANDS_FOR`'s name of a tensor-parallel layer."""
    own = {c.__name__ for c in type(module).__mro__ if issubclass(c, nn.Module) and c is not nn.Module}
    return own | {STANDS_FOR[n] for n in own if n in STANDS_FOR}


def never_called(name: str, module: nn.Module) -> bool:
    """A container or an adapter factor: ZeRO-3 could never gather its parameters around its forward."""
    return isinstance(module, CONTAINERS) or name.rsplit(".", 1)[-1] in FACTORS


def selects(kind: str, entry: str, name: str, module: nn.Module) -> bool:
    """Whether ``entry`` of ``kind`` ("zero.wrap_paths" / "zero.wrap_classes") names the module at ``name``:
    the one rule of the policy and of the check. A class names only modules whose forward runs; a path names
    whatever sits there (the check refuses a path naming a module that is never called)."""
    if kind == "zero.wrap_paths":
        return path_matches(entry, name)
    return entry in class_names(module) and not never_called(name, module)


def config_policy(root: nn.Module, paths: list[str], classes: list[str]) -> Policy:
    """The "manual" policy from the configuration: a module is a unit when its path in ``root`` matches
    one of ``paths`` or one of ``classes`` names it (:func:`selects`). ``root`` is the module as it runs
    (after LoRA, tensor and expert parallelism replaced layers at the same paths); it may be a pipeline
    rank's module, whose paths are the full model's (its stages' ``layers`` keep the model's keys), so a
    stage's units are the listed modules it holds."""
    names = {id(m): name for name, m in root.named_modules()}
    entries = [("zero.wrap_paths", p) for p in paths] + [("zero.wrap_classes", c) for c in classes]

    def policy(module: nn.Module, unwrapped: int) -> bool:
        name = names.get(id(module))
        return name is not None and any(selects(kind, e, name, module) for kind, e in entries)

    return policy


def check_wrap_targets(model: nn.Module, paths: list[str], classes: list[str]) -> None:
    """Refuse, with one sentence, a ``zero.wrap_paths`` entry or ``zero.wrap_classes`` name that selects no
    module of ``model`` (the job's model as it will run, described on the meta device) holding parameters,
    or a path that names a module whose forward never runs (a container such as ModuleDict, an adapter
    factor), so ZeRO-3 could never gather its parameters before use. Nested units are fine: a unit takes
    the parameters no unit inside it took, and gathers them around its own forward."""
    named = [(name, m) for name, m in model.named_modules() if name]
    for kind, wanted in (("zero.wrap_paths", paths), ("zero.wrap_classes", classes)):
        for w in wanted:
            found = [(n, m) for n, m in named if selects(kind, w, n, m)]
            if not found:
                known = sorted({type(m).__name__ for n, m in named if not never_called(n, m)})
                raise ConfigError(f"{kind} entry {w!r} matches no module of the model as this job runs it"
                                  + (f" (its classes: {', '.join(known)})" if kind == "zero.wrap_classes" else
                                     " (paths as named_modules() gives them, e.g. 'layers.*', 'output')"))
            boxes = [n for n, m in found if never_called(n, m)]
            if boxes:
                raise ConfigError(f"{kind} entry {w!r} names {boxes[0]!r}, a module whose forward never runs, "
                                  f"so ZeRO-3 could never gather its parameters; name "
                                  + (f"its entries instead (e.g. '{boxes[0]}.*')" if isinstance(
                                      model.get_submodule(boxes[0]), CONTAINERS) else "the layer holding it"))
            if not any(True for _, m in found for _ in m.parameters()):
                raise ConfigError(f"{kind} entry {w!r} selects only modules without parameters, so it makes "
                                  f"no ZeRO-3 unit")
