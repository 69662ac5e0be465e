"""Pipeline parallelism: partitioning, schedules as data, a checker, one executor, async weight versions."""

from tessera.pipeline.checker import CheckReport, ScheduleError, check, verify_complete
from tessera.pipeline.config import PipelineConfig
from tessera.pipeline.executor import PipelineExecutor, StepOutput
from tessera.pipeline.partition import balanced_partition, build_stage, partition_transformer, stage_modules
from tessera.pipeline.runtime import Pipeline, build_pipeline
from tessera.pipeline.schedules import SCHEDULES, Action, Schedule, build_schedule

__all__ = [
    "Action", "CheckReport", "Pipeline", "PipelineConfig", "PipelineExecutor", "SCHEDULES", "Schedule",
    "ScheduleError", "StepOutput", "balanced_partition", "build_pipeline", "build_schedule", "build_stage",
    "check", "partition_transformer", "stage_modules", "verify_complete",
]
