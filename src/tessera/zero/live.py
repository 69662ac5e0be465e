"""How much ZeRO-3 gathers ahead, and how much it may hold gathered at once (DeepSpeed's
``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters``).

Sizes are in parameters (elements) of the units' flat buffers, padding included: a unit of P elements
gathered holds P of them, whatever the dtype.

- Prefetch: the next units in the order they will run (forward order, or reverse forward order in
  backward) are gathered asynchronously, ``prefetch`` units of them, or, with ``prefetch_params`` > 0,
  as many as it takes to have at least ``prefetch_params`` parameters gathered ahead (the units already
  gathered count).
- Live limit (``max_live_params`` > 0): the parameters of every gathered flat together never exceed it.
  Prefetch stops before a unit that would pass it; before a unit that must compute is gathered, units
  gathered but not in use are released (prefetched ones, and those kept from forward to backward by
  ``reshard_after_forward=False``, which their backward gathers again), the ones needed last first.
  In use: the root (its forward encloses every other unit's), a unit inside its forward, and a unit whose
  backward has begun and whose gradient is not yet reduced. So the limit must hold the largest unit with
  the units whose forward encloses it (the root at least): a smaller one is refused.
"""

from __future__ import annotations

from tessera.errors import ConfigError


def unit_numel(unit) -> int:
    return sum(f.size for f in unit.flats)


def live_numel(units) -> int:
    """Parameters held gathered now, over every flat of ``units``."""
    return sum(f.size for u in units for f in u.flats if f.gathered)


class LiveTally:
    """Parameters held gathered now: each flat reporting to it adds its size on gather and subtracts it on
    reshard (``FlatParam.tally``), so the limit is checked in O(1), not by summing over every unit."""

    def __init__(self, numel: int = 0):
        self.numel = numel


def least_live(units) -> int:
    """The most any unit needs gathered at once: itself, with every unit whose module contains it."""
    inside = {id(u): {id(m) for m in u.module.modules()} for u in units}
    return max((sum(unit_numel(o) for o in units if id(u.module) in inside[id(o)]) for u in units), default=0)


class LivePolicy:
    """``prefetch`` units, or ``prefetch_params`` parameters, ahead; at most ``max_live_params`` gathered
    (0: no limit). ``units``: every unit of the engine, the root first."""

    def __init__(self, units: list, prefetch: int, prefetch_params: int, max_live_params: int):
        self.units, self.prefetch = units, prefetch
        self.prefetch_params, self.max_live = prefetch_params, max_live_params
        self.peak = 0  # the most parameters held gathered at once (recorded under a live limit)
        self.tally = LiveTally(live_numel(units))  # every flat of ``units`` keeps it up to date
        for f in (f for u in units for f in u.flats):
            f.tally = self.tally
        need = least_live(units)
        if max_live_params and max_live_params < need:
            raise ConfigError(f"zero.max_live_params={max_live_params} is smaller than the {need} parameters "
                              f"ZeRO-3 must hold gathered at once (the largest unit with the units enclosing it, "
                              f"the root included); set at least {need}, or 0 for no limit")

    @property
    def active(self) -> bool:
        return bool(self.prefetch or self.prefetch_params)

    def ahead(self, candidates: list) -> list:
        """The units of ``candidates`` (in the order they will run) to gather asynchronously now."""
        if not self.prefetch_params:
            chosen = candidates[: self.prefetch]
        else:
            chosen, total = [], 0
            for u in candidates:
                if total >= self.prefetch_params:
                    break
                chosen.append(u)
                total += unit_numel(u)
        if not self.max_live:
            return chosen
        live, out = self.tally.numel, []
        for u in chosen:
            extra = sum(f.size for f in u.flats if not f.gathered)
            if live + extra > self.max_live:
                break
            live += extra
            out.append(u)
        return out

    def make_room(self, unit, order: list, busy) -> None:
        """Before ``unit`` is gathered to compute: release units not in use (``busy(u)`` False), needed
        last first, until it fits under the limit. ``order``: the forward order recorded so far."""
        if not self.max_live:
            return
        extra = sum(f.size for f in unit.flats if not f.gathered)
        if self.tally.numel + extra <= self.max_live:
            return
        at = order.index(unit) if unit in order else len(order)
        # earlier units are needed again last (in backward, reverse order); then later ones, farthest first
        for other in order[:at] + order[at + 1 :][::-1]:
            if other is unit or other.is_root or busy(other) or not any(f.gathered for f in other.flats):
                continue
            other.reshard()
            if self.tally.numel + extra <= self.max_live:
                return

    def record(self) -> None:
        if self.max_live:
            self.peak = max(self.peak, self.tally.numel)
