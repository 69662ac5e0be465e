"""ZeRO-3 / FSDP: parameters, gradients and optimizer state all sharded over ``dp_shard``, in units.

Per unit (a module chosen by a wrap policy; the root takes the rest) and per optimizer param group,
one :class:`FlatParam`. Forward communication: an all-gather of the unit's parameters just before its
forward (the all-gathers of the next ``prefetch`` units in forward order are started right after, so
they overlap this unit's compute), freed after the forward when ``reshard_after_forward``. Backward
communication: the all-gather again just before the unit's backward (prefetching the ``prefetch`` units
before it whose backward is still to come), then one reduce-scatter (sum) of the unit's gradient as soon
as its backward ends, and, with hybrid sharding, an all-reduce of the slice over ``dp_replicate``
(ZeRO's one slice reduction, ``tessera.zero.reduce``). Per step: 2 all-gathers + 1 reduce-scatter =
1.5× DDP's bytes.

Memory bound: with ``reshard_after_forward`` at most ``prefetch`` + 1 units other than the root are
gathered at once, in forward and in backward (``prefetch`` = 0: only the unit computing; the forward
order is learnt in the first forward, which therefore prefetches nothing). The root unit's forward
encloses every other unit's, so it stays gathered through the forward until its gradient is reduced
(with the ``block`` wrap policy it holds only the final norm). ``reshard_after_forward=False`` (per
unit through ``wrap()``, or for all) keeps a unit gathered from its forward to its backward: one
all-gather per step instead of two, and every such unit's full parameters held between the passes.
``prefetch_params`` (prefetch by parameters, not units) and ``max_live_params`` (a cap on the parameters
gathered at once, releasing units not in use): ``tessera.zero.live``.

Dtypes, with parameters in a low precision (``param_dtype`` bf16 / fp16): the shard ``shard.param`` [n],
the all-gathered unit ``full`` [P] and its gradient ``full.grad`` [P] are in ``param_dtype`` (an
all-gather moves 2 bytes per parameter, not 4); the gradient is reduce-scattered in ``reduce_dtype``
(cast first when it differs) into ``shard.grad`` [n]; the fp32 master ``shard.master`` [n] is what the
optimizer steps, and ``shard.param`` takes its rounded values after each step.

Frozen parameters (``requires_grad=False``, a LoRA job's base weights): each unit holds them in one more
flat, sharded and gathered with the others (they are the memory ZeRO-3 exists to divide) but with no
gradient, no reduce-scatter, no master and no optimizer state; in a low ``param_dtype`` they are held in it
alone. A unit that mixes frozen and trainable parameters has both kinds of flat. No gradient hook says when
a frozen flat's backward is over, so an identity on the unit's inputs does: its backward runs once the
unit's input gradients exist, and frees the frozen flats (``_after_backward``); a unit whose inputs need
no gradient (the first block of a LoRA model) keeps them until the end of backward.

Built from the meta device: parameters on the meta device that carry an initial-value origin
(``tessera.models.init``) are never allocated whole. Each :class:`FlatParam` fills only this rank's slice
from the origins (no broadcast: every rank computes the same values); frozen parameters included, so no
rank ever holds a whole parameter (with expert parallelism each engine takes its own frozen ones);
buffers first of all.

Why not the data-parallel reducer's buckets and in-order launch (``tessera.data_parallel.reducer``,
which ZeRO-1/2 use): here a unit's gradient arrives already flat in ``full.grad`` (the unit is the
bucket, chosen by the wrap policy, with no copy into a slot), and it must be reduced, then the unit's
parameters and gradient freed, the moment that unit's backward ends, in the order autograd finishes
the units; holding it until every earlier-indexed unit is done would keep full parameters and
gradients alive, which is what ZeRO-3 exists to avoid. There is no ``no_sync`` (every backward reduces).

Manual mode (``manual=True``, for a pipeline: many forwards and backwards per step on sub-modules of the
wrapped module, which itself is never called): no reduction from backward; each unit's full gradient
[P] accumulates in ``full.grad`` over the step's backwards, and :meth:`reduce_gradients` reduce-scatters
every flat once (then the replica all-reduce) and frees the full gradients and parameters. With
``reshard_after_forward`` a unit is gathered for every micro-batch's forward and again for its backward
(2·m all-gathers per flat per step for m micro-batches); without, it stays gathered from first use until
``reduce_gradients`` (1 per flat per step; the full parameters of every unit held through the step).
The root unit's forward never runs, so its parameters (e.g. a pipeline's final norm) are gathered by a
pre-forward hook on each module that owns one, and stay gathered until ``reduce_gradients``. No
prefetch: the schedule, not the module order, decides which unit runs next.

Works with activation checkpointing: a recomputed forward runs the pre-forward hook again, which
finds the unit already gathered for its backward and does not free it afterwards.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.comm.group import CommGroup
from tessera.models.init import materialize_buffers
from tessera.zero.flat import named_params_by_id, slice_segments
from tessera.zero.flat_param import FlatParam
from tessera.zero.live import LivePolicy
from tessera.zero.reduce import SliceReduction
from tessera.zero.shards import ShardedUpdate
from tessera.zero.wrap import Policy, select_units, unit_settings


class _OnBackward(torch.autograd.Function):
    """Identity on some tensors whose backward first calls ``fn()``: on a unit's outputs it gathers the
    unit's parameters (before its backward), on its inputs it frees the frozen ones (after it)."""

    @staticmethod
    def forward(ctx, fn, *xs):
        ctx.fn = fn
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)


class Unit:
    """One wrapped module: its flat parameters (one per param group) and its schedule state."""

    def __init__(self, engine, module: nn.Module, flats: list[FlatParam], is_root: bool, reshard: bool):
        self.engine, self.module, self.flats, self.is_root = engine, module, flats, is_root
        self.frozen = [f for f in flats if not f.trainable]
        self.reshard_after_forward = reshard and not is_root  # the root is needed again at once
        self.in_backward = False

    def gather(self, async_op: bool = False) -> None:
        for f in self.flats:
            f.gather(async_op)

    def reshard(self) -> None:
        for f in self.flats:
            f.reshard()

    def use_views(self) -> None:
        for f in self.flats:
            f.use_views()

    def done_backward(self) -> bool:
        """Every trainable flat's gradient of the current backward was reduced (the unit is not needed
        again, or, holding only frozen flats, needs no gradient)."""
        return all(f.reduced for f in self.flats if f.trainable)


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 around ``module``: ``policy`` picks the units (see ``tessera.zero.wrap``)."""

    def __init__(self, module: nn.Module, param_groups: list[dict], make_optimizer, shard: CommGroup,
                 replicate: CommGroup, policy: Policy, device: torch.device,
                 reshard_after_forward: bool = True, prefetch: int = 1, prefetch_params: int = 0,
                 max_live_params: int = 0, param_dtype: torch.dtype = torch.float32, reduce_dtype=None,
                 offload_device: torch.device | None = None, norm_axes: dict[str, CommGroup] | None = None,
                 param_axes=None, manual: bool = False, frozen=None):
        """``prefetch`` (units; ``True``/``False`` = 1/0), ``prefetch_params``, ``max_live_params``: gathering
        ahead and its limit (``tessera.zero.live``); ``norm_axes`` / ``param_axes``: as for ZeroDataParallel;
        ``manual``: reduce only in :meth:`reduce_gradients`; ``frozen``: the frozen parameters it shards."""
        super().__init__()
        self.module, self.manual = module, manual
        self.shard_group, self.replicate_group = shard, replicate
        self.reduce_dtype = reduce_dtype or param_dtype
        self.reduction = SliceReduction(shard, replicate, self.reduce_dtype)
        self.prefetch = 0 if manual else int(prefetch)
        materialize_buffers(module, device)  # before the flats take the parameters its hooks may read
        # flat group g: the parameters of param group g; -1: the frozen ones (no gradient, no master)
        group_of = {id(p): g for g, grp in enumerate(param_groups) for p in grp["params"]}
        group_of.update({id(p): -1 for p in (module.parameters() if frozen is None else frozen)
                         if not p.requires_grad})
        names = named_params_by_id(module)
        modules = select_units(module, policy)
        owner_unit = _owning_units(module, modules, group_of)
        make_flat = dict(shard=shard, replicate=replicate, device=device, dtype=param_dtype,
                         offload_device=offload_device)
        self.units: list[Unit] = []
        for m in modules:
            settings = unit_settings(m) or {}
            flats = []
            for g in [*range(len(param_groups)), -1]:
                entries = [(p, locs, names[id(p)]) for p, (u, locs) in owner_unit.items()
                           if u is m and group_of.get(id(p)) == g]
                if entries:
                    flat = FlatParam(entries, g, trainable=g >= 0, **make_flat)
                    if param_axes is not None and flat.trainable:
                        flat.shard.segments = slice_segments(
                            flat.offsets, [s.numel() for s in flat.shapes],
                            [frozenset(param_axes(p)) for p, _, _ in entries], shard.rank, shard.size, flat.size)
                    flats.append(flat)
            unit = Unit(self, m, flats, m is module, settings.get("reshard_after_forward", reshard_after_forward))
            self.units.append(unit)
            m.register_forward_pre_hook(lambda mod, args, u=unit: self._pre_forward(u, args))
            m.register_forward_hook(lambda mod, args, out, u=unit: self._post_forward(u, out))
            for f in flats:
                if f.trainable:
                    f.full.register_post_accumulate_grad_hook(lambda t, u=unit, f=f: self._post_backward(u, f))
        if manual:  # the root is never called: gather it wherever its parameters are used
            for owner in {id(o): o for f in self.units[0].flats for locs in f.locations for o, _ in locs}.values():
                owner.register_forward_pre_hook(lambda mod, args: self._use_root())
        self.order: list[Unit] = []  # forward order, recorded on the first forward
        self.live = LivePolicy(self.units, self.prefetch, 0 if manual else prefetch_params, max_live_params)
        self._pending: list = []  # (flat, pending reduction) in launch order
        self._queued, self._active = False, set()  # _active: the units inside their forward
        options = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        self.flats = [f for u in self.units for f in u.flats if f.trainable]  # reduced, with masters
        self.frozen_flats = [f for u in self.units for f in u.frozen]
        self.update = ShardedUpdate([f.shard for f in self.flats], options, make_optimizer, shard,
                                    [shard, replicate, *(norm_axes or {}).values()], device, norm_axes)
        self.optimizer = self.update.optimizer

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ---- forward ---------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, args: tuple):
        if not unit.in_backward and unit not in self.order:
            self.order.append(unit)
        self._active.add(unit)
        self.live.make_room(unit, self.order, self._busy)
        unit.gather()
        unit.use_views()
        if self.live.active and not unit.in_backward:
            for ahead in self.live.ahead(self.order[self.order.index(unit) + 1 :]):
                ahead.gather(async_op=True)
        self.live.record()
        if unit.frozen and not unit.is_root and not unit.in_backward and torch.is_grad_enabled():
            return _on_backward(args, lambda: self._after_backward(unit))  # new args, or None: unchanged
        return None

    def _post_forward(self, unit: Unit, out):
        self._active.discard(unit)
        if unit.in_backward:  # a recomputation inside backward: keep the parameters for the backward
            return out
        if torch.is_grad_enabled():
            out = _on_backward(out, lambda: self.before_backward(unit))
        if unit.reshard_after_forward:
            unit.reshard()
        return out

    def _use_root(self) -> None:
        root = self.units[0]
        root.gather()
        root.use_views()

    # ---- backward --------------------------------------------------------------------------------
    def before_backward(self, unit: Unit) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if unit.in_backward:
            return
        unit.in_backward = True
        self.live.make_room(unit, self.order, self._busy)
        unit.gather()
        unit.use_views()
        if self.live.active and unit in self.order:
            # the units whose backward comes next: earlier in forward order, gradient not yet reduced
            # (e.g. the root, whose final norm's gradient arrives first, is not gathered again)
            before = [u for u in reversed(self.order[: self.order.index(unit)]) if not u.done_backward()]
            for behind in self.live.ahead(before):
                behind.gather(async_op=True)
        self.live.record()

    def _busy(self, unit: Unit) -> bool:
        """In use: inside its forward, or its backward begun and its gradient not yet reduced."""
        return unit in self._active or (unit.in_backward and not unit.done_backward())

    def _after_backward(self, unit: Unit) -> None:
        """The unit's input gradients exist, so its backward is over: free its frozen flats, which no
        gradient hook frees (manual mode: when it reshards after forward, as its trainable flats)."""
        if not self.manual or unit.reshard_after_forward:
            for f in unit.frozen:
                f.reshard()

    def _post_backward(self, unit: Unit, flat: FlatParam) -> None:
        if self.manual:  # the gradient stays in full.grad, accumulating until reduce_gradients
            flat.reduced = True  # (its gradient of this backward arrived: the unit is no longer in use)
            if unit.reshard_after_forward:
                flat.reshard()
            return
        grad, flat.full.grad = flat.full.grad, None
        flat.reduced = True
        self._pending.append((flat, flat.launch_reduce(grad, self.reduction)))
        flat.reshard()
        # the earlier reduce-scatters had this unit's backward to overlap with: finish them now, so
        # at most one full gradient stays alive while backward goes on
        while len(self._pending) > 1:
            self._complete(*self._pending.pop(0))

    def _complete(self, flat: FlatParam, pending) -> None:
        flat.keep_grad(self.reduction.finish(pending))

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """Reduce flat params whose gradient never arrived (as zeros, so every rank issues the same
        calls), wait for the reduce-scatters in launch order, all-reduce across replicas, keep slices.
        Manual mode: only end the pass (free what ``reshard_after_forward`` frees; no reduction)."""
        if self.manual:
            for u in self.units:
                u.in_backward = False
                if u.reshard_after_forward:
                    u.reshard()
            for f in self.flats:
                f.reduced = False
            self._queued = False
            return
        for f in self.flats:
            if not f.reduced:
                self._pending.append((f, f.launch_reduce(None, self.reduction)))
        for pending in self._pending:
            self._complete(*pending)
        self._pending.clear()
        for f in self.flats:
            f.reduced = False
        for u in self.units:
            u.in_backward = False
            u.reshard()
        self._queued = False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Manual mode, once per step after the last backward: reduce-scatter every flat's accumulated
        gradient [P] (zeros where none arrived) in one fixed order on every rank, keep this rank's slice
        [P/N], free the full gradients and every unit's gathered parameters (the root's too)."""
        if not self.manual:
            raise RuntimeError("reduce_gradients is for manual mode; otherwise every backward reduces")
        for f in self.flats:
            grad, f.full.grad = f.full.grad, None
            self._pending.append((f, f.launch_reduce(grad, self.reduction)))
            while len(self._pending) > 1:  # one reduce-scatter in flight while the next is launched
                self._complete(*self._pending.pop(0))
        for pending in self._pending:
            self._complete(*pending)
        self._pending.clear()
        for u in self.units:
            u.in_backward = False
            u.reshard()

    # ---- the step ------------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float, inv_scale: float = 1.0) -> tuple[float, bool]:
        finite = self.update.prepare_grads(inv_scale)
        norm = self.update.clip(max_norm) if finite else float("inf")
        return norm, finite

    def step(self) -> None:
        """Update this rank's slices (no communication: the next forward gathers the new values)."""
        self.update.step()
        self.gather_params()

    def gather_params(self) -> None:
        """After the slices changed: free every gathered copy (one kept since an evaluation holds the old
        values); every forward gathers the current slices."""
        for u in self.units:
            u.reshard()

    def zero_grad(self) -> None:
        self.update.zero_grad()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = self.update.tensors()  # frozen flats: their shard (and gathered storage) only, no master
        out["params"] = out["params"] + [f.shard.param for f in self.frozen_flats] + [
            f.full for f in self.flats + self.frozen_flats]  # gathered storage counts while held
        out["grads"] = out["grads"] + [f.full.grad for f in self.flats if f.full.grad is not None]  # manual
        return out

    def flat_shards(self) -> list[tuple[torch.Tensor, int, list[tuple[str, tuple, int]]]]:
        """Per flat parameter: (fp32 master slice [n], this rank's index in the shard group, [(parameter
        name in ``module``, shape, offset)]), as ``ZeroDataParallel.flat_shards``."""
        return [(f.shard.master, f.group_shard.rank, list(zip(f.names, map(tuple, f.shapes), f.offsets)))
                for f in self.flats]

    def full_state(self) -> dict[str, torch.Tensor]:
        """Qualified name → full parameter value, frozen ones included (collective: every rank calls it)."""
        out = {}
        for f in self.flats + self.frozen_flats:
            out.update(f.full_values())
        return out


def _on_backward(out, fn):
    """``out`` (a tensor, or a tuple / list of values) with the tensors that need a gradient passed through
    one :class:`_OnBackward` calling ``fn`` (``out`` itself when none does)."""
    if isinstance(out, torch.Tensor):
        return _OnBackward.apply(fn, out)[0] if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        idx = [i for i, x in enumerate(out) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            return out
        new = _OnBackward.apply(fn, *[out[i] for i in idx])
        items = list(out)
        for i, x in zip(idx, new):
            items[i] = x
        return type(out)(items)
    return out


def _owning_units(root: nn.Module, units: list[nn.Module], taken: dict) -> dict:
    """parameter → (unit module, [(owner module, attribute)...]) for the trainable parameters and those
    frozen ones in ``taken`` (id → flat group); a parameter used from two units (tied weights) belongs to
    the root, which is gathered whenever either runs."""
    unit_ids = {id(m) for m in units}
    found: dict = {}

    def visit(module: nn.Module, unit: nn.Module) -> None:
        if id(module) in unit_ids:
            unit = module
        for attr, p in module._parameters.items():
            if p is None or not (p.requires_grad or id(p) in taken):
                continue
            u, locs = found.get(p, (unit, []))
            found[p] = (u if u is unit else root, locs + [(module, attr)])
        for child in module.children():
            visit(child, unit)

    visit(root, root)
    return found

