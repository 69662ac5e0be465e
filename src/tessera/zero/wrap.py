"""Which modules become ZeRO-3 / FSDP units: auto-wrap policies and manual ``wrap()``.

A policy is a callable ``policy(module, unwrapped_params) -> bool`` asked for every module below the
root, children first; ``unwrapped_params`` counts the parameters of the module not already in a unit
below it. The root is always a unit (it takes whatever no other unit took).

    size_policy(min_params)       a module whose not-yet-wrapped parameters number at least min_params
                                  (torch FSDP's default_auto_wrap_policy, seed 001)
    class_policy(TransformerBlock) every instance of the given classes (torchtitan's per-block units)
    manual: inside ``with enable_wrap(**settings):`` ``wrap(module)`` marks module as a unit (with
            per-unit settings such as reshard_after_forward); outside the context wrap() does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from torch import nn

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
