"""One runtime for every schedule: it walks this rank's action list and does what each action says.

The executor reaches the model only through its stage modules and a step callback
``loss_fn(output, target) -> scalar`` called on the last stage (the scalar is what gets back-propagated:
with tessera's convention, the micro-batch's summed token loss divided by the global token count), so no
loss or batch key is hard-coded. Micro-batches are ``(input, target)`` pairs; every pipeline rank is given
the same list (stage 0 reads the inputs, the last stage the targets).

Communication (axis "pp", through ``tessera.comm.p2p`` so the ledger records it): forward sends the stage
output activation_BSD to the next stage's rank, backward sends the gradient of the stage input to the
previous stage's rank. Sends are isend (waited at the end of the step); receives are irecv posted as soon
as the action before the preceding compute starts, so transfers overlap compute. Once an activation's send
has completed, its data is freed (only its autograd node is needed for the backward, as in Megatron).

Without a flush (``flush=False``, pipedream / 2bw) ``step(micro, lookahead)`` also runs the next step's first
forwards (``lookahead``: that step's micro-batches) and keeps their state — stage inputs, outputs, their
weight versions and unfinished sends — for the next call, which then starts in the steady state; a call
without ``lookahead`` ends with the cool-down (the pipeline is drained: validation, checkpoints, the end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils.checkpoint import checkpoint

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.pipeline.schedules import COMPUTE, Action, Schedule, continuing_schedule
from tessera.pipeline.split_backward import WeightGradStore, split_linears
from tessera.pipeline.weight_versions import WeightVersions, shift_microbatches
from tessera.timeline import Timeline


@dataclass
class StepOutput:
    losses: list[torch.Tensor]  # loss_fn's value per micro-batch (detached) on the last stage's rank, else []
    peak_activations: int  # most micro-batches whose stage activations this rank held at once


@dataclass
class _StepState:
    micro: list  # [(input, target)] of this step
    inputs: dict = field(default_factory=dict)  # (stage, mb) -> stage input (requires grad) for B
    outputs: dict = field(default_factory=dict)  # (stage, mb) -> stage output (or loss on the last stage)
    grads_out: dict = field(default_factory=dict)  # (stage, mb) -> gradient of the stage output (local)
    grads_in: dict = field(default_factory=dict)  # (stage, mb) -> gradient of the stage input, to send
    recvs: dict = field(default_factory=dict)  # (kind, stage, mb) -> (buffer, Handle)
    sends: list = field(default_factory=list)  # [Handle, tensor kept alive, (stage, mb) to free or None]
    posted: set = field(default_factory=set)  # indices of RECV actions already posted
    losses: list = field(default_factory=list)
    peak: int = 0


class PipelineExecutor:
    """Runs ``schedule`` for pipeline rank ``pp.rank`` over its ``stages`` ({virtual stage: module})."""

    def __init__(self, stages: dict[int, nn.Module], schedule: Schedule, pp: CommGroup,
                 loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
                 activation_shape: Callable[[Any], Sequence[int]], activation_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, timeline: Timeline | None = None, recompute: bool = False,
                 on_step: Callable[[], None] | None = None, free_sent: bool = True,
                 vertical_sync: bool = False, flush: bool = True,
                 before_compute: Callable[[str, int, int, Any], None] | None = None):
        if sorted(stages) != schedule.stages_of(pp.rank):
            raise ValueError(f"rank {pp.rank} holds stages {sorted(stages)} but the schedule puts "
                             f"{schedule.stages_of(pp.rank)} on it")
        self.stages, self.schedule, self.pp = stages, schedule, pp
        self.loss_fn, self.activation_shape, self.dtype = loss_fn, activation_shape, activation_dtype
        self.device = torch.device(device) if device is not None else pp.device  # default: the pp group's
        self.timeline = timeline or Timeline(pp.rank, enabled=False)
        self.recompute, self.on_step, self.free_sent = recompute, on_step, free_sent
        # before_compute(kind "F" or "B", stage, mb, (input, target)): tells a stage module about the
        # micro-batch it is about to run (a B may recompute the forward); mb numbers m.. are the look-ahead's
        self.before_compute = before_compute
        self.last = schedule.n_stages - 1
        self.stores = {s: WeightGradStore() for s in stages}
        # Asynchronous schedules run each micro-batch on a stashed weight version (weight_versions.py).
        self.versions = (WeightVersions(stages, schedule, pp.rank, vertical_sync)
                         if schedule.name in ("pipedream", "2bw") else None)
        if schedule.split_backward:
            for s, module in stages.items():
                split_linears(module, self.stores[s])
        # no flush: the step's schedule by (pipeline empty at the start?, next step's batches given?)
        self.variants = None if flush else {
            (warm, look): continuing_schedule(schedule.name, schedule.pp, schedule.n_microbatches, warm, look)
            for warm in (True, False) for look in (True, False)}
        self._carried: _StepState | None = None  # in-flight micro-batches of the next step (no flush)
        self.current: Action | None = None  # the compute action running (a stage's loss weight reads it)

    @property
    def drained(self) -> bool:
        """No micro-batch is in flight (always, with a flush)."""
        return self._carried is None

    def parameters(self):
        for module in self.stages.values():
            yield from module.parameters()

    # ---- the step ------------------------------------------------------------------------------------

    def step(self, microbatches: list[tuple[Any, Any]], lookahead: list[tuple[Any, Any]] | None = None
             ) -> StepOutput:
        """Run this rank's actions for one batch of micro-batches; gradients accumulate in ``.grad``.
        ``lookahead`` (no flush only): the next step's micro-batches, whose first forwards run in this step's
        cool-down slots; without it the pipeline drains. Only this step's micro-batches reach ``.grad``."""
        m = self.schedule.n_microbatches
        if len(microbatches) != m or (lookahead is not None and len(lookahead) != m):
            raise ValueError(f"schedule '{self.schedule.name}' expects {m} micro-batches per step, got "
                             f"{len(microbatches)}" + (f" and {len(lookahead)}" if lookahead is not None else ""))
        if lookahead is not None and self.variants is None:
            raise ValueError("a lookahead needs an executor without a flush (flush=False)")
        schedule = self.schedule if self.variants is None else self.variants[(self.drained, lookahead is not None)]
        st = self._carried or _StepState(micro=[])
        st.micro, st.losses, st.posted, st.peak = list(microbatches) + list(lookahead or []), [], set(), 0
        if self.versions is not None:
            self.versions.begin_step(schedule)
        acts = schedule.actions[self.pp.rank]
        for i, a in enumerate(acts):
            if a.kind in COMPUTE:
                self._prefetch(acts, i, st)
                self._free_completed(st)
                self._await_inputs(a, st)  # outside the compute span: waiting is bubble, not work
                self.current = a
                if self.before_compute is not None and a.kind in ("F", "B"):
                    self.before_compute(a.kind, a.stage, a.mb, st.micro[a.mb])
                with self.timeline.span(f"{a.kind}{a.stage}.{a.mb}", "compute"):
                    getattr(self, f"_{a.kind.lower()}")(a, st)
                self.current = None
            elif a.kind in ("RECV_F", "RECV_B"):
                self._post_recv(acts, i, st)
            elif a.kind == "SEND_F":
                out = st.outputs[(a.stage, a.mb)].detach().contiguous()  # SP's outputs can be strided
                st.sends.append([comm.isend(out, self.pp, a.peer), out, (a.stage, a.mb)])
            elif a.kind == "SEND_B":
                g = st.grads_in.pop((a.stage, a.mb)).contiguous()
                st.sends.append([comm.isend(g, self.pp, a.peer), g, None])
            elif a.kind == "STEP":
                if self.versions is not None:
                    self.versions.before_update()
                if self.on_step is not None:
                    with self.timeline.span("STEP", "compute"):
                        self.on_step()
        if lookahead is not None:  # sends to the next step's forwards complete when their peers receive them
            self._carried = _carry(st, m)
            if self.versions is not None:
                self.versions.carry(m)
            return StepOutput(st.losses, st.peak)
        self._carried = None
        with self.timeline.span("wait sends", "comm"):
            for h, _, _ in st.sends:
                h.wait()
        return StepOutput(st.losses, st.peak)

    # ---- communication helpers -----------------------------------------------------------------------

    def _post_recv(self, acts: list[Action], i: int, st: _StepState) -> None:
        if i in st.posted:
            return
        a = acts[i]
        x = st.micro[a.mb][0]
        buf = torch.empty(tuple(self.activation_shape(x)), dtype=self.dtype, device=self.device)
        st.recvs[(a.kind, a.stage, a.mb)] = (buf, comm.irecv(buf, self.pp, a.peer))
        st.posted.add(i)

    def _prefetch(self, acts: list[Action], i: int, st: _StepState) -> None:
        """Post the receives the *next* compute action needs, so they arrive while this one runs."""
        j = i + 1
        while j < len(acts) and acts[j].kind not in COMPUTE:
            if acts[j].kind.startswith("RECV"):
                self._post_recv(acts, j, st)
            j += 1

    def _await_inputs(self, a: Action, st: _StepState) -> None:
        key = ("RECV_F" if a.kind == "F" else "RECV_B", a.stage, a.mb)
        if a.kind in ("F", "B") and key in st.recvs:
            with self.timeline.span(f"wait {key[0][-1]}{a.stage}.{a.mb}", "comm"):
                st.recvs[key][1].wait()

    def _take(self, st: _StepState, key: tuple) -> torch.Tensor:
        buf, handle = st.recvs.pop(key)
        handle.wait()  # already waited by _await_inputs: returns at once
        return buf

    def _free_completed(self, st: _StepState) -> None:
        """Drop the data of activations whose send has finished (their autograd node stays)."""
        if not self.free_sent:
            return
        for entry in st.sends:
            handle, _, key = entry
            if key is None or handle is None or not handle.is_completed():
                continue
            out = st.outputs.get(key)
            if out is not None:
                out.data = torch.empty(0, dtype=out.dtype, device=out.device)
            entry[1], entry[2] = None, None

    # ---- compute actions -----------------------------------------------------------------------------

    def _f(self, a: Action, st: _StepState) -> None:
        x, y = st.micro[a.mb]
        if a.stage == 0:
            inp = x.to(self.device) if isinstance(x, torch.Tensor) else x
        else:
            key = ("RECV_F", a.stage, a.mb)
            inp = self._take(st, key).requires_grad_() if key in st.recvs else st.inputs[(a.stage, a.mb)]
            st.inputs[(a.stage, a.mb)] = inp
        module = self.stages[a.stage]
        if self.versions is not None:
            out = self.versions.forward(a.stage, a.mb, inp)
        elif self.recompute:
            out = checkpoint(module, inp, use_reentrant=False)
        else:
            out = module(inp)
        if a.stage == self.last:
            out = self.loss_fn(out, y.to(self.device) if isinstance(y, torch.Tensor) else y)
            st.losses.append(out.detach())
        elif (a.stage + 1) % self.schedule.pp == self.pp.rank:  # next stage on this rank: hand over
            st.inputs[(a.stage + 1, a.mb)] = out.detach().requires_grad_()
        st.outputs[(a.stage, a.mb)] = out
        st.peak = max(st.peak, len(st.outputs))

    def _b(self, a: Action, st: _StepState) -> None:
        out = st.outputs.pop((a.stage, a.mb))
        if a.stage == self.last:
            grad = None
        elif ("RECV_B", a.stage, a.mb) in st.recvs:
            grad = self._take(st, ("RECV_B", a.stage, a.mb))
        else:
            grad = st.grads_out.pop((a.stage, a.mb))
        if self.schedule.split_backward:
            with self.stores[a.stage].defer(a.mb):
                _backward(out, grad)
        else:
            _backward(out, grad)
        if self.versions is not None:
            self.versions.after_backward(a.stage, a.mb)
        if a.stage > 0:
            g_in = st.inputs.pop((a.stage, a.mb)).grad
            if (a.stage - 1) % self.schedule.pp == self.pp.rank:
                st.grads_out[(a.stage - 1, a.mb)] = g_in
            else:
                st.grads_in[(a.stage, a.mb)] = g_in

    def _w(self, a: Action, st: _StepState) -> None:
        self.stores[a.stage].flush(a.mb)


def _carry(st: _StepState, m: int) -> _StepState:
    """The state a step without a flush leaves to the next: its micro-batches m.. become the next step's 0..
    (stage inputs and outputs of the in-flight forwards; every unfinished send, waited at a drain)."""
    if st.grads_out or st.grads_in or st.recvs:
        raise RuntimeError("a step ended with gradients or receives pending: the schedule is incomplete")
    sends = [[h, t, None if key is None else (key[0], key[1] - m)] for h, t, key in st.sends
             if h is not None and not (h.is_completed() and key is None)]  # finished and freed: dropped
    return _StepState(micro=[], inputs=shift_microbatches(st.inputs, m),
                      outputs=shift_microbatches(st.outputs, m), sends=sends)


def _backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from ``out`` (a scalar loss when ``grad`` is None). Calls the engine directly, as Megatron's
    custom_backward does, because ``out.data`` may have been freed after its send (shape check skipped)."""
    if grad is None:
        out.backward()
        return
    Variable._execution_engine.run_backward(
        tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True,
    )


