"""Pipeline schedules as pure data: per rank, the ordered list of actions one optimizer step performs.

A schedule is built in two passes: a generator orders the *compute* actions of every rank (forward F,
backward B — or, when the backward is split, input-gradient B and weight-gradient W — and the optimizer
STEP), then :func:`add_communication` inserts the SEND/RECV actions each compute action implies (a forward
on a stage whose predecessor lives on another rank first receives that activation; its output is sent to
the successor's rank right after it is computed; gradients flow the same way backwards). Nothing here
touches torch: the checker simulates these lists, the executor runs them.

Stages are *virtual* stages 0..S-1 in model order; with ``v`` chunks per rank, stage ``s`` lives on rank
``s % pp`` (Megatron's interleaved placement), so v = 1 gives stage s on rank s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.errors import ConfigError

COMPUTE = ("F", "B", "W")
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw")


@dataclass(frozen=True)
class Action:
    """One step of one rank. ``kind``: F (forward), B (backward; input-gradient only when the schedule
    splits the backward), W (weight gradient), SEND_F/RECV_F (activation), SEND_B/RECV_B (gradient),
    STEP (optimizer). ``stage`` is the virtual stage, ``mb`` the micro-batch (-1 for STEP), ``peer`` the
    pp-group rank a message goes to / comes from (-1 for compute)."""

    kind: str
    stage: int = -1
    mb: int = -1
    peer: int = -1

    def __str__(self) -> str:
        if self.kind == "STEP":
            return "STEP"
        tail = f"->{self.peer}" if self.kind.startswith("SEND") else f"<-{self.peer}" if self.peer >= 0 else ""
        return f"{self.kind}(stage={self.stage}, mb={self.mb}){tail}"


@dataclass
class Schedule:
    """Ordered actions per rank plus the facts needed to run or check them."""

    name: str
    pp: int  # ranks in the pipeline
    n_stages: int  # virtual stages = pp * virtual_stages
    n_microbatches: int
    split_backward: bool  # B is input-gradient only and W actions carry the weight gradients
    actions: list[list[Action]] = field(default_factory=list)  # actions[rank] in execution order

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.n_stages, self.pp))

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMPUTE]

    def __str__(self) -> str:
        rows = [f"rank {r}: " + " ".join(_short(a) for a in acts) for r, acts in enumerate(self.actions)]
        return f"{self.name} pp={self.pp} stages={self.n_stages} m={self.n_microbatches}\n" + "\n".join(rows)


def _short(a: Action) -> str:
    if a.kind == "STEP":
        return "S"
    if a.kind in COMPUTE:
        return f"{a.kind}{a.stage}.{a.mb}"
    return f"{a.kind[0].lower()}{a.kind[-1]}{a.stage}.{a.mb}"


# ---- compute orders ----------------------------------------------------------------------------------

def _gpipe(pp: int, m: int) -> list[list[Action]]:
    return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)] for r in range(pp)]


def _one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """PipeDream-flush: rank r runs pp-r-1 warm-up forwards, then alternates F/B, then drains."""
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        acts = [Action("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", r, warm + i), Action("B", r, i)]
        acts += [Action("B", r, i) for i in range(m - warm, m)]
        out.append(acts)
    return out


def _interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: forward micro-step k runs chunk (k // pp) % v on micro-batch
    (k // (pp*v))*pp + k % pp; backward mirrors it from the last chunk; m must be a multiple of pp."""
    total = m * v

    def fwd(r: int, k: int) -> Action:
        chunk = (k // pp) % v
        return Action("F", chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    def bwd(r: int, k: int) -> Action:
        chunk = v - 1 - (k // pp) % v
        return Action("B", chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    out = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        acts = [fwd(r, k) for k in range(warm)]
        for k in range(total - warm):
            acts += [fwd(r, warm + k), bwd(r, k)]
        acts += [bwd(r, k) for k in range(total - warm, total)]
        out.append(acts)
    return out


def _zb_h1(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, Fig. 3): 1F1B's order with the backward split into B (input gradient) and W
    (weight gradient). Rank r runs each W right after its B, except that it holds back the W's of its first
    r micro-batches: a later rank returns the gradient upstream (B only) while the earlier ranks still warm
    up, and its held-back W's fill the time it would otherwise wait. Every rank then keeps at most pp
    micro-batches between their F and their W, the first rank's bound under 1F1B, so the peak memory over
    ranks is 1F1B's; with unit F, B and W the idle time per rank is (p - 1)(F + B - W), a third of 1F1B's.
    The same order as torch.distributed.pipelining's ScheduleInterleavedZeroBubble with one stage per rank."""
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        acts = [Action("F", r, i) for i in range(warm)]
        done = {"B": 0, "W": 0}

        def backward(acts=acts, done=done, r=r):
            acts.append(Action("B", r, done["B"]))
            done["B"] += 1
            if done["B"] > r:  # the W's of the first r micro-batches wait
                acts.append(Action("W", r, done["W"]))
                done["W"] += 1
        for i in range(warm, m):
            acts.append(Action("F", r, i))
            backward()
        while done["B"] < m:
            backward()
        acts += [Action("W", r, j) for j in range(done["W"], m)]
        out.append(acts)
    return out


def _async_1f1b(pp: int, m: int) -> list[list[Action]]:
    """PipeDream async: 1F1B without a flush between batches; each rank steps its optimizer right after
    every backward (one weight version per micro-batch, weight stashing keeps F and B on one version)."""
    out = []
    for acts in _one_f_one_b(pp, m):
        with_steps = []
        for a in acts:
            with_steps.append(a)
            if a.kind == "B":
                with_steps.append(Action("STEP"))
        out.append(with_steps)
    return out


def _continuing_1f1b(pp: int, m: int, warm: bool, lookahead: bool, steps: bool) -> list[list[Action]]:
    """One optimizer step of 1F1B *without a flush* (PipeDream, 2BW as the papers run them): rank r keeps
    w = pp-r-1 micro-batches in flight across the step boundary. Micro-batches 0..m-1 are this step's,
    m..m+w-1 the next step's first w (the lookahead). ``warm``: the pipeline starts empty, so the step
    opens with the warm-up forwards 0..w-1; otherwise those ran in the previous step. ``lookahead``: the
    steady state goes on into the next step's forwards where a flush would drain; otherwise the step ends
    with the cool-down. warm and not lookahead is exactly :func:`_one_f_one_b`. ``steps``: an optimizer
    update (STEP) after every backward (PipeDream)."""
    out = []
    for r in range(pp):
        w = pp - r - 1  # m >= pp (PipelineConfig.validate), so the lookahead stays within the next step
        acts = [Action("F", r, i) for i in range(w)] if warm else []
        for k in range(m):
            if w + k < m or lookahead:
                acts.append(Action("F", r, w + k))
            acts.append(Action("B", r, k))
            if steps:
                acts.append(Action("STEP"))
        out.append(acts)
    return out


def continuing_schedule(name: str, pp: int, m: int, warm: bool, lookahead: bool) -> Schedule:
    """The schedule of one step of ``pipedream`` / ``2bw`` with ``pipeline.flush = false`` (see
    :func:`_continuing_1f1b`); its micro-batch indices run to m + pp - 2 (the lookahead)."""
    check_shape(name, pp, m, 1)
    compute = _continuing_1f1b(pp, m, warm, lookahead, steps=name == "pipedream")
    return Schedule(name, pp, pp, m, False, add_communication(compute, pp, pp))


def concatenate(steps: list[Schedule]) -> Schedule:
    """Consecutive steps of continuing schedules as one schedule over global micro-batch numbers (step t's
    micro-batch i is t*m + i), for the checker: it proves the run deadlock-free and gives its timing."""
    first = steps[0]
    m, acts = first.n_microbatches, [[] for _ in range(first.pp)]
    for t, sched in enumerate(steps):
        for r, seq in enumerate(sched.actions):
            acts[r] += [Action(a.kind, a.stage, a.mb + t * m if a.mb >= 0 else a.mb, a.peer) for a in seq]
    return Schedule(first.name, first.pp, first.n_stages, m * len(steps), False, acts)


def forward_only(pp: int, m: int, v: int = 1) -> Schedule:
    """Evaluation: every micro-batch's forward through all (virtual) stages, no backward."""
    n = pp * v
    compute = [[Action("F", s, i) for s in range(r, n, pp) for i in range(m)] for r in range(pp)]  # chunk-major
    return Schedule("forward", pp, n, m, False, add_communication(compute, pp, n))


def build_compute(name: str, pp: int, m: int, v: int = 1) -> tuple[list[list[Action]], int, bool]:
    """(compute actions per rank, number of virtual stages, split backward?) for a named schedule."""
    if name == "naive":
        return _gpipe(pp, 1), pp, False
    if name == "gpipe" or name == "2bw":
        acts = _gpipe(pp, m) if name == "gpipe" else _one_f_one_b(pp, m)
        return acts, pp, False
    if name == "1f1b":
        return _one_f_one_b(pp, m), pp, False
    if name == "interleaved":
        return _interleaved(pp, m, v), pp * v, False
    if name == "zb-h1":
        return _zb_h1(pp, m), pp, True
    if name == "pipedream":
        return _async_1f1b(pp, m), pp, False
    raise ConfigError(f"unknown pipeline schedule '{name}'; use one of {', '.join(SCHEDULES)}.")


def check_shape(name: str, pp: int, m: int, v: int) -> None:
    """One-sentence errors for micro-batch / stage counts a schedule cannot run."""
    if pp < 1 or m < 1 or v < 1:
        raise ConfigError(f"pipeline needs pp, microbatches and virtual_stages >= 1, got {pp}, {m}, {v}.")
    if v > 1 and name != "interleaved":
        raise ConfigError(f"virtual_stages={v} needs schedule 'interleaved', not '{name}'.")
    if name == "interleaved" and m % pp:
        raise ConfigError(f"interleaved 1F1B needs microbatches ({m}) to be a multiple of pp ({pp}).")


# ---- communication -----------------------------------------------------------------------------------

def add_communication(compute: list[list[Action]], pp: int, n_stages: int) -> list[list[Action]]:
    """Insert RECV before and SEND after every compute action whose neighbour stage is on another rank."""
    out = []
    for r, acts in enumerate(compute):
        seq = []
        for a in acts:
            if a.kind == "F":
                if a.stage > 0 and (a.stage - 1) % pp != r:
                    seq.append(Action("RECV_F", a.stage, a.mb, (a.stage - 1) % pp))
                seq.append(a)
                if a.stage < n_stages - 1 and (a.stage + 1) % pp != r:
                    seq.append(Action("SEND_F", a.stage, a.mb, (a.stage + 1) % pp))
            elif a.kind == "B":
                if a.stage < n_stages - 1 and (a.stage + 1) % pp != r:
                    seq.append(Action("RECV_B", a.stage, a.mb, (a.stage + 1) % pp))
                seq.append(a)
                if a.stage > 0 and (a.stage - 1) % pp != r:
                    seq.append(Action("SEND_B", a.stage, a.mb, (a.stage - 1) % pp))
            else:
                seq.append(a)
        out.append(seq)
    return out


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
                   with_step: bool = False) -> Schedule:
    """The full schedule (compute + communication) of one optimizer step; ``with_step`` appends STEP to
    flush schedules (async ones carry their own STEP actions)."""
    check_shape(name, pp, microbatches, virtual_stages)
    compute, n_stages, split = build_compute(name, pp, microbatches, virtual_stages)
    if with_step and name not in ("pipedream",):
        compute = [acts + [Action("STEP")] for acts in compute]
    m = 1 if name == "naive" else microbatches
    return Schedule(name, pp, n_stages, m, split, add_communication(compute, pp, n_stages))
