"""Data-parallel modes other than DDP (``ddp.mode``): how replicas combine when they exchange at the step.

Each mode assembles several strategies (parameter servers, local SGD, DataParallel, ZeRO engines, the
gradient norm, the loss scale), so it lives in the training layer:

- ``base``: the interface the trainer calls (:class:`DataParallelMode`) and what a mode is built from
  (:class:`ModeParts`);
- ``registry``: ``MODES`` ((mode, consistency) -> builder), ``build_mode`` and ``validate_modes`` (what each
  mode cannot compose with, refused before launch);
- ``assemble``: the trainer's side (model-side strategies, then the mode; per stage under a pipeline);
- the modes: ``local_sgd`` (local-sgd), ``ps_sync`` (ps-rank0 / ps-sharded, sync), ``ps_async`` (ps-rank0 /
  ps-sharded, ssp / async), ``single_process`` (dataparallel / central-storage).
"""
