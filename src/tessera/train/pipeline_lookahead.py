"""``pipeline.flush = false``: the next step's batches, fetched one step early, so that their first forwards
fill this step's cool-down (PipeDream / PipeDream-2BW without a flush; ``tessera.pipeline.executor``).

The pipeline step (``tessera.train.pipeline_step``) hands the look-ahead batches to its executor and
weights their stages' own loss terms by :attr:`LookAhead.divisor`, the global token count of the step
they belong to. Only stages before the last run look-ahead forwards: the last stage's forward of a
micro-batch is followed by its loss and backward in the same step, so the token loss always belongs to
the step being run (``PipelineStep._loss_fn`` asserts it).

Where the trainer's loop is followed by validation, a periodic checkpoint or the end of training
(:func:`drains_after`) no look-ahead is fetched: the pipeline drains and the sampler stands exactly after
that step, so a checkpoint resumes exactly.
"""

from __future__ import annotations

from typing import Callable

import torch

Batches = list[tuple[torch.Tensor, torch.Tensor]]  # one step's micro-batches: (x_BS, y_BS) token ids


class LookAhead:
    """The batches fetched a step early. ``enabled``: ``pipeline.flush = false`` with more than one pp
    rank (with one, nothing is ever in flight, so no look-ahead is fetched)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._pending: Batches | None = None  # the next step's batches, fetched with this one
        self._ahead: Batches | None = None  # the same, until this step's forward_backward takes them
        self.divisor = 1.0  # the global token count of the look-ahead batches' step (set by their taker)

    def take_batches(self, fetch: Callable[[], Batches], drain: bool) -> Batches:
        """This step's batches (``fetch()`` gives the sampler's next step). When enabled and no ``drain``
        follows this step, the next step's are fetched now as well, for :meth:`take_ahead`; ``drain``:
        validation, a checkpoint or the end follows, so the pipeline empties and the sampler stands
        exactly after this step."""
        batches = self._pending if self._pending is not None else fetch()
        self._pending = None if (not self.enabled or drain) else fetch()
        self._ahead = self._pending
        return batches

    @property
    def holds_next(self) -> bool:
        """Whether the next step's batches are fetched already (the sampler stands a step further on)."""
        return self._pending is not None

    def take_ahead(self) -> Batches | None:
        """The next step's batches to run ahead in this step (once per ``take_batches``), or None."""
        ahead, self._ahead = self._ahead, None
        return ahead


def drains_after(step: int, job) -> bool:
    """Whether the trainer's step ``step`` of JobConfig ``job`` is followed by validation, a periodic
    checkpoint or the end of training: the pipeline is drained there, so a checkpoint resumes exactly."""
    every = job.checkpoint.every
    return step % job.train.eval_every == 0 or step >= job.train.steps or bool(every and step % every == 0)
