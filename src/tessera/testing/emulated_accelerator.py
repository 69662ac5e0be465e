"""Run CPU code as if it were on an accelerator, so a tensor a GPU job would leave on the host is caught here.

On a GPU job a tensor made without a device (``torch.zeros(n)``), moved with ``.cpu()`` or built from host
memory (``torch.frombuffer``) lands on the CPU while its group's collectives run on the GPU, and NCCL
rejects it. On a CPU-only machine the host and the "device" are the same, so nothing fails. Inside
``with EmulatedAccelerator(device):``

* ``device`` plays the accelerator. It defaults to ``cpu:0``: a CPU device (so everything still computes
  here) that differs from the host device ``cpu`` where device-less tensors land.
* A *host* tensor is one a GPU job would hold on the host: made by a factory without ``device=`` or with
  a CPU device other than the emulated one (``"cpu"``, ``torch.device("cpu")``), by ``.cpu()``,
  ``.to("cpu")``, ``torch.frombuffer``, ``torch.from_numpy`` or ``torch.get_rng_state``, or computed
  from host tensors only. Its ``.device`` reads ``cpu``; every other CPU tensor's reads ``device``.
* ``.to(device)`` (the emulated device, or any non-host tensor's ``.device``) makes a non-host copy, as a
  host-to-device copy would. A result computed from at least one non-host tensor is non-host (a host 0-d
  scalar mixes with device tensors on a GPU as well); in-place ops keep their target's kind, indexing
  its source's; ``nn.Parameter`` and ``.data =`` carry the kind of the tensor they wrap.
* ``backward()`` runs the autograd engine with the emulation still on, so gradient hooks and custom
  ``Function.backward`` methods (where most collectives of a step are issued) see it too; it keeps torch's
  checks (an implicit gradient only for a scalar output, a given gradient of the output's shape). Python called
  from inside a single op (saved-tensor hooks) runs without it, as any torch-function mode; activation
  checkpointing's forward/recompute metadata check therefore compares real devices.

Groups built by ``Topology.build(cfg, ledger, device)`` with the same device then see a host tensor on
another device, and ``tessera.comm`` raises its DeviceMismatchError: the error a GPU job would hit.

Not seen (so not caught): tensors made by the legacy constructors (``torch.Tensor(...)``) or by C++ code
that bypasses Python's torch-function protocol; a host tensor that meets a non-scalar device tensor in
compute (an error on a GPU, taken as device here); code that the emulated run does not execute.
"""

from __future__ import annotations

import inspect

import torch
import torch.utils.checkpoint
from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
from torch.autograd.graph import GradientEdge, _engine_run_backward
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

_HOST = WeakIdKeyDictionary()  # tensor -> True for the host tensors made under an emulation
_HOST_SOURCES = ("frombuffer", "from_numpy", "get_rng_state")  # host memory, not torch functions
_BACKWARD = (torch.Tensor.backward, torch.autograd.backward)
_DEVICE_GET = torch.Tensor.device.__get__
_DATA_SET = torch.Tensor.data.__set__
_TRANSFERS = ("to", "cpu")


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t`` was made as a host tensor under an emulation (see the module docstring)."""
    return t in _HOST


def _mark(t: torch.Tensor, host: bool) -> None:
    if host:
        _HOST[t] = True
    else:
        _HOST.pop(t, None)


class EmulatedAccelerator(TorchFunctionMode):
    """``with EmulatedAccelerator(device):`` tells host tensors apart from ``device`` ones on a CPU run."""

    def __init__(self, device: torch.device | str = torch.device("cpu", 0)):
        super().__init__()
        self.device = torch.device(device)
        if self.device.type != "cpu" or self.device == torch.device("cpu"):
            raise ValueError(f"the emulated accelerator must be a CPU device other than 'cpu', got {self.device}")
        self._saved: dict = {}
        self._depth = 0  # entered again by backward(): patch and restore at the outermost level only

    # ---- entering: functions that make host tensors outside the torch-function protocol ----------------
    def __enter__(self):
        if self._depth == 0:
            import torch._dynamo  # noqa: F401  (it registers a stand-in for _make_subclass on import: not ours)

            for name in _HOST_SOURCES:
                self._saved[name] = original = getattr(torch, name)
                setattr(torch, name, _marking(original))
            self._saved["_make_subclass"] = make = torch.Tensor._make_subclass
            torch.Tensor._make_subclass = staticmethod(_keeping_kind(make))  # nn.Parameter(t) keeps t's kind
            checks = torch.utils.checkpoint._allowed_determinism_checks_to_fns
            self._saved["checkpoint_metadata"] = checks["default"]
            checks["default"] = _real_metadata
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for name in _HOST_SOURCES:
                setattr(torch, name, self._saved[name])
            torch.Tensor._make_subclass = staticmethod(self._saved["_make_subclass"])
            torch.utils.checkpoint._allowed_determinism_checks_to_fns["default"] = self._saved["checkpoint_metadata"]
        return super().__exit__(*exc)

    # ---- every torch function call ------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GET:
            return self._device_of(args[0])
        if func in _BACKWARD:
            return self._backward(func, args, kwargs)
        out = func(*args, **kwargs)
        if func == _DATA_SET:  # p.data = t: p now holds t's data
            _mark(args[0], is_host(args[1]))
            return out
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = self._result_on_host(name, args, kwargs, tensors)
        if host is None:
            return out
        inputs = {id(t) for t in tensors}
        if isinstance(out, torch.Tensor):
            return self._settle(out, host, inputs, name)
        if isinstance(out, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            return tree_map(lambda t: self._settle(t, host, inputs, name), out)
        return out  # no tensor in it (a torch.Size, a number...): returned untouched

    def _device_of(self, t: torch.Tensor) -> torch.device:
        real = _DEVICE_GET(t)
        if real.type != "cpu":
            return real
        return torch.device("cpu") if is_host(t) else self.device

    def _on_host(self, device) -> bool | None:
        """Whether a tensor made for ``device`` (a ``device=`` argument) lands on the host."""
        if device is None:
            return True  # the default device: the host's CPU on a GPU job
        if isinstance(device, int):
            return False  # an accelerator index
        device = torch.device(device)
        return None if device.type != "cpu" else device != self.device

    def _result_on_host(self, name: str, args, kwargs, tensors: list) -> bool | None:
        """Whether the result of ``name(*args, **kwargs)`` (tensor inputs ``tensors``) is a host tensor;
        None: leave it as it is."""
        if name == "cpu":
            return True
        if name == "to":
            return self._to_host(args, kwargs)
        if not tensors or kwargs.get("device") is not None:  # a factory, or *_like / new_* with a device
            return self._on_host(kwargs.get("device"))
        if name == "__getitem__":
            return is_host(args[0])
        if (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name == "__setitem__":
            return None  # in place: the target keeps its kind
        return all(is_host(t) for t in tensors)

    def _to_host(self, args, kwargs) -> bool | None:
        """``t.to(...)``: to another tensor's kind, to a device, or (dtype only) t's own kind."""
        other = next((a for a in (*args[1:], kwargs.get("other")) if isinstance(a, torch.Tensor)), None)
        if other is not None:
            return is_host(other)
        device = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                device = a
        return is_host(args[0]) if device is None else self._on_host(device)

    @staticmethod
    def _settle(t, host: bool, inputs: set, name: str):
        """Mark a result tensor; a transfer that returned its input unchanged (same real device) returns a
        copy instead, as a transfer between host and device would."""
        if not isinstance(t, torch.Tensor) or is_host(t) == host:
            return t
        if id(t) in inputs:
            if name not in _TRANSFERS:
                return t
            t = t.clone()
        _mark(t, host)
        return t

    def _backward(self, func, args, kwargs) -> None:
        """``backward()`` as ``torch.autograd.backward`` runs it once past its torch-function dispatch:
        torch's own argument handling and gradient checks (``_make_grads``: an implicit gradient only for a
        scalar floating output, a given one of the output's shape and kind), then torch's engine call, with
        this emulation on so that hooks and custom ``Function.backward`` methods see it."""
        bound = inspect.signature(func).bind(*args, **kwargs).arguments
        if func is torch.Tensor.backward:  # what Tensor.backward hands to torch.autograd.backward
            bound["tensors"], bound["grad_tensors"] = bound.pop("self"), bound.pop("gradient", None)
        tensors, inputs = (_as_tuple(bound.get(name)) for name in ("tensors", "inputs"))
        if bound.get("inputs") is not None and not inputs:
            raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
        grads = bound.get("grad_tensors")
        grads = bound.get("grad_variables") if grads is None else grads  # the deprecated name
        create = bool(bound.get("create_graph", False))
        retain = bound.get("retain_graph")
        with self:
            grads = _tensor_or_tensors_to_tuple(grads, len(tensors))
            grads = _make_grads(tensors, grads, is_grads_batched=False)
            _engine_run_backward(tensors, grads, create if retain is None else retain, create, inputs,
                                 allow_unreachable=True, accumulate_grad=True)


def _as_tuple(x) -> tuple:
    """``tensors`` / ``inputs`` of ``backward()`` as torch reads them: one tensor or gradient edge, a
    dict (its values) or a sequence; None is empty."""
    if x is None:
        return ()
    if isinstance(x, (torch.Tensor, GradientEdge)):
        return (x,)
    return tuple(x.values() if isinstance(x, dict) else x)


def _real_metadata(x: torch.Tensor) -> dict:
    """What activation checkpointing compares between forward and recomputation, with the real device:
    the forward side is read inside an op (where no torch-function mode runs), so the emulated device
    would differ from the recomputation's for no reason."""
    with torch._C.DisableTorchFunction():
        return {"shape": x.shape, "dtype": x.dtype, "device": x.device}


def _marking(make):
    """``make`` (a function returning a tensor of host memory), its result marked as a host tensor."""
    def wrapper(*args, **kwargs):
        t = make(*args, **kwargs)
        _mark(t, True)
        return t
    return wrapper


def _keeping_kind(make):
    """``Tensor._make_subclass`` (behind ``nn.Parameter``) whose result has the kind of its data."""
    def wrapper(cls, data, *args, **kwargs):
        t = make(cls, data, *args, **kwargs)
        _mark(t, is_host(data))
        return t
    return wrapper
