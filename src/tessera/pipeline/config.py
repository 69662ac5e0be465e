"""Configuration of pipeline parallelism (the ``[pipeline]`` section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.errors import ConfigError
from tessera.pipeline.schedules import SCHEDULES, check_shape

PARTITION_METHODS = ("params", "uniform", "cost", "explicit")


@dataclass
class PipelineConfig:
    schedule: str = "1f1b"  # one of naive, gpipe, 1f1b, interleaved, zb-h1, pipedream, 2bw
    microbatches: int = 4  # micro-batches per optimizer step (ignored by naive, which runs the whole batch)
    virtual_stages: int = 1  # model chunks per rank; > 1 only with schedule "interleaved"
    partition: str = "params"  # params (balance parameter counts), uniform (layer counts), cost, explicit
    layers: list[list[int]] = field(default_factory=list)  # explicit: layer indices per virtual stage
    layer_costs: list[float] = field(default_factory=list)  # cost: measured or estimated cost per layer
    recompute: bool = False  # re-run each stage's forward in its backward (GPipe re-materialisation)
    vertical_sync: bool = False  # pipedream: every stage uses the weight version of stage 0 at the F
    timeline: bool = True  # record each action's start/end (Chrome trace + PNG Gantt in the run folder)
    flush: bool = True  # pipedream / 2bw: false keeps the pipeline full across optimizer steps (no drain)

    def validate(self, pp: int = 1, n_layers: int | None = None, batch_size: int | None = None,
                 routing_losses: bool = False, dynamic_loss_scale: bool = False) -> PipelineConfig:
        """Raise ConfigError (one sentence) for settings that cannot run; pass the pp degree, the model's
        layer count and the per-rank batch size when known, and whether stages add routing (MoE auxiliary)
        losses under a dynamic loss scale (both matter to ``flush = false``)."""
        self._validate_flush(pp, routing_losses and dynamic_loss_scale)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline.schedule '{self.schedule}' is unknown; use one of {', '.join(SCHEDULES)}.")
        if self.partition not in PARTITION_METHODS:
            raise ConfigError(f"pipeline.partition '{self.partition}' is unknown; use one of "
                              f"{', '.join(PARTITION_METHODS)}.")
        check_shape(self.schedule, pp, self.microbatches, self.virtual_stages)
        if self.recompute and self.schedule in ("pipedream", "2bw"):
            raise ConfigError(f"pipeline.recompute is not supported with schedule '{self.schedule}' "
                              "(its stashed weight versions already keep each stage's activations).")
        if self.vertical_sync and self.schedule != "pipedream":
            raise ConfigError("pipeline.vertical_sync applies only to schedule 'pipedream'.")
        stages = pp * self.virtual_stages
        if n_layers is not None and stages > n_layers:
            raise ConfigError(f"pipeline needs at least one layer per stage, but pp={pp} x virtual_stages="
                              f"{self.virtual_stages} = {stages} stages exceeds the model's {n_layers} layers.")
        if self.partition == "explicit" and len(self.layers) != stages:
            raise ConfigError(f"pipeline.layers lists {len(self.layers)} stages but the pipeline has {stages}.")
        if self.partition == "cost" and n_layers is not None and len(self.layer_costs) != n_layers:
            raise ConfigError(f"pipeline.layer_costs has {len(self.layer_costs)} entries but the model has "
                              f"{n_layers} layers.")
        m = 1 if self.schedule == "naive" else self.microbatches
        if batch_size is not None and pp > 1 and batch_size % m:  # pp = 1: no pipeline, no split
            raise ConfigError(f"pipeline.microbatches={m} does not divide the batch size {batch_size}.")
        return self

    def _validate_flush(self, pp: int, scaled_routing: bool) -> None:
        if self.flush:
            return
        if self.schedule not in ("pipedream", "2bw"):
            raise ConfigError(f"pipeline.flush = false applies only to the weight-stashing schedules 'pipedream' "
                              f"and '2bw' (schedule '{self.schedule}' must drain to update all stages at once).")
        if pp > 1 and self.microbatches < pp:
            raise ConfigError(f"pipeline.flush = false needs at least as many micro-batches as stages "
                              f"(microbatches={self.microbatches} < pp={pp}), as PipeDream-2BW requires.")
        if scaled_routing:
            raise ConfigError("pipeline.flush = false cannot run MoE routing losses under a dynamic loss scale: "
                              "a stage puts the scale into the routing loss at the forward, and the next step's "
                              "first forwards run before this step's overflow check decides that step's scale.")
