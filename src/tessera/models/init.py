"""Initial parameter values as a function of (seed, parameter name), never of the layout.

Why: a rank must allocate only what it holds (its tp slice, its stages, its ZeRO shard, its experts) and
still start from exactly the values one process has. So every parameter of the whole model is described
by an :class:`InitSpec` (its whole-model name and shape, its distribution, the seed). Its elements, in
row-major order, are cut into chunks of :data:`CHUNK` elements and chunk k is drawn from a CPU generator
seeded by hash(seed, name, k). Any part of any parameter is produced by drawing only the chunks it
touches, one at a time: initialising costs the temporaries of about one chunk however big the model (the
drawn chunk, and for a sliced parameter the indices and masks of a piece of CHUNK / 8 elements), and the
values do not depend on the device (drawn on the CPU, then copied).

The values need not be drawn: any *source* of a whole parameter's elements serves, an object with
``numel``, ``constant`` (a float every element equals, or None) and ``chunk(k)`` (elements [k·CHUNK,
(k+1)·CHUNK) of the flattened whole, fp32 on the CPU). :class:`InitSpec` draws them; a tensor of a
Hugging Face safetensors file reads them through a memory map (``tessera.hf.safetensors_file``), so
loading pretrained weights into any layout is this same mechanism with another source.

A parameter created on the meta device carries an :class:`Origin`: its source and the chain of strided
regions through which it was cut out of the whole parameter. :func:`assign` records a region wherever a
parallel layer takes a slice of a dense weight (on real tensors it simply copies), :func:`materialize`
allocates each meta parameter on a device and fills it, and ZeRO-3 fills a flat shard straight from the
origins of the parameters it covers (:meth:`Origin.fill_`), so no rank ever holds a whole parameter it
does not own.

Buffers are not parameters: they hold no initial values to draw but values derived from the module's
configuration (RoPE tables, a padding mask), created in ``__init__`` and so on the meta device too. A
module with such buffers defines ``init_buffers(device)``, which (re)creates them on ``device``;
:func:`materialize` calls it on every module left with a meta buffer (and refuses a meta buffer no hook
recreates). Other tensors a module makes in ``__init__`` (counters that are no buffers) are created on the
CPU explicitly and move where they are first used.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

CHUNK = 1 << 18  # elements per independently seeded chunk (1 MiB of fp32)
KINDS = ("normal", "ones", "zeros")
_ORIGIN = "_tessera_origin"


def _chunk_seed(seed: int, name: str, k: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Source(Protocol):
    """The elements of a whole parameter, chunk by chunk (see the module doc): drawn or read."""

    @property
    def numel(self) -> int: ...

    @property
    def constant(self) -> float | None: ...

    def chunk(self, k: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class InitSpec:
    """How the whole parameter ``name`` of ``shape`` starts: N(0, std²), ones or zeros."""

    name: str
    shape: tuple[int, ...]
    kind: str = "normal"
    std: float = 0.02
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"init kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def constant(self) -> float | None:
        """The value of every element (ones, zeros), or None when they are drawn."""
        return None if self.kind == "normal" else (1.0 if self.kind == "ones" else 0.0)

    def chunk(self, k: int) -> torch.Tensor:
        """Elements [k·CHUNK, (k+1)·CHUNK) of the flattened whole parameter: fp32 on the CPU."""
        n = min(CHUNK, self.numel - k * CHUNK)
        if self.constant is not None:
            return torch.full((n,), self.constant)
        g = torch.Generator().manual_seed(_chunk_seed(self.seed, self.name, k))
        return torch.randn(n, generator=g).mul_(self.std)

    def values(self) -> torch.Tensor:
        """The whole parameter (fp32, CPU): for tests and one-process builds of small models."""
        out = torch.empty(self.shape)
        Origin(self).fill_(out)
        return out


@dataclass(frozen=True)
class Region:
    """A strided view of a tensor: local element (i_0, i_1, …) of ``sizes`` (C order) is the source's flat
    element ``offset + Σ_d i_d·strides[d]``. With ``rows`` set, only local rows i_0 < rows come from the
    source and the others are zero (padding, e.g. vocabulary rows added so tp divides the vocabulary)."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    rows: int | None = None

    def map(self, local: torch.Tensor) -> torch.Tensor:
        """local flat indices [n] (int64; -1 = padding) → source flat indices [n] (-1 = padding)."""
        pad = local < 0
        rem, out = local.clamp(min=0), torch.full_like(local, self.offset)
        for d in reversed(range(len(self.sizes))):
            i_d = rem % self.sizes[d]
            rem = rem // self.sizes[d]
            out += i_d * self.strides[d]
            if d == 0 and self.rows is not None:
                pad |= i_d >= self.rows
        return out.masked_fill_(pad, -1)


@dataclass(frozen=True)
class Origin:
    """Where a (possibly sliced) parameter's values come from: ``source``'s whole parameter (an
    :class:`InitSpec`, or any object with its ``numel``, ``constant`` and ``chunk(k)``: see the module
    doc), seen through ``regions`` (the first is taken of the whole parameter, each next one of the
    previous result)."""

    source: Source
    regions: tuple[Region, ...] = ()

    def then(self, region: Region) -> Origin:
        return Origin(self.source, self.regions + (region,))

    def indices(self, start: int, end: int) -> torch.Tensor:
        """Whole-parameter flat indices [end-start] (int64, -1 = zero padding) of local elements [start, end)."""
        idx = torch.arange(start, end, dtype=torch.int64)
        for region in reversed(self.regions):
            idx = region.map(idx)
        return idx

    @torch.no_grad()
    def fill_(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Write local flat elements [start, start + out.numel()) into ``out`` (contiguous, any dtype and
        device); returns ``out``. Temporaries: the chunk being drawn or read (one cached), and for a sliced
        parameter the indices of one piece of CHUNK / 8 local elements."""
        flat = out.view(-1)
        value = self.source.constant
        if value is not None and not any(r.rows is not None for r in self.regions):
            return out.fill_(value)
        cache: dict[int, torch.Tensor] = {}
        if not self.regions:  # contiguous: copy chunk parts straight in, no index tensor
            self._copy_range(flat, start, start, flat.numel(), cache)
            return out
        piece = max(1, CHUNK // 8)
        for a in range(0, flat.numel(), piece):
            b = min(flat.numel(), a + piece)
            idx = self.indices(start + a, start + b)
            if bool(idx[0] >= 0) and int(idx[-1] - idx[0]) == b - a - 1 and bool((idx.diff() == 1).all()):
                self._copy_range(flat[a:b], int(idx[0]), int(idx[0]), b - a, cache)  # a contiguous run
            else:
                flat[a:b].copy_(self._gather(idx, cache))
        return out

    def _chunk(self, k: int, cache: dict) -> torch.Tensor:
        if k not in cache:
            cache.clear()  # one chunk alive at a time
            cache[k] = self.source.chunk(k)
        return cache[k]

    def _copy_range(self, dest: torch.Tensor, origin: int, lo: int, n: int, cache: dict) -> None:
        """dest[i - origin] = whole[i] for whole-parameter flat elements i in [lo, lo + n)."""
        i = lo
        while i < lo + n:
            k = i // CHUNK
            j = min(lo + n, (k + 1) * CHUNK)
            dest[i - origin : j - origin].copy_(self._chunk(k, cache)[i - k * CHUNK : j - k * CHUNK])
            i = j

    def _gather(self, idx: torch.Tensor, cache: dict) -> torch.Tensor:
        """fp32 CPU values at whole-parameter flat indices ``idx`` (-1: zero)."""
        out = torch.zeros(idx.numel())
        valid = idx >= 0
        if not bool(valid.any()):
            return out
        chunk_of = torch.where(valid, idx // CHUNK, -1)
        for k in torch.unique(chunk_of[valid]).tolist():
            sel = chunk_of == k
            out[sel] = self._chunk(k, cache)[idx[sel] - k * CHUNK]
        return out


def origin_of(t: torch.Tensor) -> Origin | None:
    return getattr(t, _ORIGIN, None)


def set_origin(t: torch.Tensor, origin: Origin) -> torch.Tensor:
    setattr(t, _ORIGIN, origin)
    return t


def init_parameter(p: torch.Tensor, spec: InitSpec) -> None:
    """Give ``p`` (the whole parameter ``spec.name``) its initial values, or on the meta device its origin."""
    if tuple(p.shape) != tuple(spec.shape):
        raise ValueError(f"{spec.name}: parameter shape {tuple(p.shape)} is not the spec's {spec.shape}")
    set_origin(p, Origin(spec))
    if not p.is_meta:
        Origin(spec).fill_(p.data)


def assign(dest: torch.Tensor, src: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """``dest`` ← ``src``, a view of a parameter (a tensor-parallel slice, a block of a grid, …); with
    ``rows``, ``src`` fills dest's first ``rows`` rows and the rest are zero. On the meta device nothing is
    copied: dest records where its values come from (``src``'s origin seen through the view), so
    :func:`materialize` or ZeRO-3 can fill it later. Returns ``dest``."""
    if dest.is_meta or src.is_meta:
        if not (dest.is_meta and src.is_meta):
            raise ValueError("assign: both tensors must be on the meta device, or neither")
        base = src._base if src._base is not None else src
        origin = origin_of(base)
        if origin is None:
            raise ValueError("assign: the source is not a parameter with an initial-value origin "
                             "(take the slice as a view of the parameter itself, before .contiguous())")
        if not base.is_contiguous():
            raise ValueError("assign: the source's base tensor must be contiguous")
        region = Region(src.storage_offset() - base.storage_offset(), tuple(dest.shape), tuple(src.stride()), rows)
        if rows is None and tuple(src.shape) != tuple(dest.shape):
            raise ValueError(f"assign: shapes differ, {tuple(src.shape)} into {tuple(dest.shape)}")
        identity = rows is None and region.offset == 0 and src.shape == base.shape and src.is_contiguous()
        set_origin(dest, origin if identity else origin.then(region))
        return dest
    with torch.no_grad():
        if rows is None:
            dest.copy_(src)
        else:
            dest[:rows].copy_(src)
            dest[rows:].zero_()
    return dest


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> int:
    """Replace every meta parameter of ``module`` by one on ``device`` (``dtype``: default the meta
    parameter's) filled from its origin; tied parameters stay one tensor and keep their attributes
    (e.g. tensor-parallel marks, the origin). Then every module left with a meta buffer recreates its
    buffers on ``device`` (``init_buffers``, see the module doc). Real parameters and buffers are left as
    they are. Returns the bytes allocated for parameters."""
    done: dict[int, nn.Parameter] = {}
    allocated = 0
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                origin = origin_of(p)
                if origin is None:
                    raise ValueError(f"materialize: parameter {name} of {type(m).__name__} has no origin")
                t = origin.fill_(torch.empty(p.shape, dtype=dtype or p.dtype, device=device))
                new = nn.Parameter(t, requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                done[id(p)] = new
                allocated += t.numel() * t.element_size()
            m._parameters[name] = done[id(p)]
    materialize_buffers(module, device)
    return allocated


def materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Let every module of ``module`` holding a meta buffer recreate its buffers on ``device`` (its
    ``init_buffers(device)``); a meta buffer without that hook is an error (nothing could fill it)."""
    for m in module.modules():
        meta = [name for name, b in m._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        if not hasattr(m, "init_buffers"):
            raise ValueError(f"materialize: {type(m).__name__} has meta buffers {meta} but no init_buffers(device)")
        m.init_buffers(device)
        left = [name for name, b in m._buffers.items() if b is not None and b.is_meta]
        if left:
            raise ValueError(f"materialize: {type(m).__name__}.init_buffers left {left} on the meta device")


def copy_origins(source: nn.Module, target: nn.Module) -> None:
    """Give ``target``'s parameters the origins of ``source``'s parameters of the same qualified name
    (``copy.deepcopy`` of a module drops tensor attributes)."""
    origins = {n: origin_of(p) for n, p in source.named_parameters(remove_duplicate=False)}
    for n, p in target.named_parameters(remove_duplicate=False):
        if origins.get(n) is not None:
            set_origin(p, origins[n])


def check_materialized(module: nn.Module) -> None:
    """Raise if a parameter or buffer of ``module`` is still on the meta device (a strategy that took the
    model on meta and left something behind would otherwise fail deep inside the first forward)."""
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after the model was built: {', '.join(left[:5])}"
                           + (f" and {len(left) - 5} more" if len(left) > 5 else ""))

