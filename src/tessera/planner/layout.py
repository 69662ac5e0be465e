"""A parallel layout the planner can evaluate: degrees, ZeRO stage, micro-batching, memory savers."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Layout:
    """One way to run a model on ``dp·pp·tp·cp`` GPUs (ep is carved out of dp, as in tessera.topology)."""

    dp: int = 1  # data-parallel degree (replicas, or ZeRO shards)
    zero_stage: int = 0  # 0 = DDP, 1 optimizer states, 2 + gradients, 3 + parameters sharded over dp
    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel degree
    sp: bool = False  # sequence parallelism inside the tensor-parallel group
    cp: int = 1  # context-parallel degree (sequence split across ranks for attention)
    ep: int = 1  # expert-parallel degree (divides dp; MoE models only)
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    recompute: str = "none"  # activation recomputation: none, selective, full
    offload: bool | str = False  # optimizer states (and the update) on the host: True; in files: "disk"
    schedule: str = "none"  # pipeline schedule: none (pp = 1), gpipe, 1f1b, interleaved, zb-h1
    virtual_stages: int = 1  # model chunks per stage for the interleaved schedule

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each data-parallel rank runs per step (gradient-accumulation count)."""
        return global_batch // (self.dp * self.micro_batch)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"dp={self.dp}"]
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + ("+sp" if self.sp else ""))
        if self.pp > 1:
            sched = self.schedule + (f"(v={self.virtual_stages})" if self.schedule == "interleaved" else "")
            parts.append(f"pp={self.pp} {sched}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts.append(f"mb={self.micro_batch}")
        if self.recompute != "none":
            parts.append(f"rc={self.recompute}")
        if self.offload:
            parts.append("offload" if self.offload is True else f"offload={self.offload}")
        return " ".join(parts)
