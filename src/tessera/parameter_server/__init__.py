"""Parameter-server mode for sparse models (torch.distributed.rpc), plus the dense variants the seeds
compare it with: parameter server on rank 0, sharded parameter server, ring all-reduce, local SGD, and
single-process multi-device DataParallel / central storage."""

from tessera.parameter_server.clicklog import ClickLog, auc
from tessera.parameter_server.config import PSConfig
from tessera.parameter_server.errors import PSError
from tessera.parameter_server.job import run_ps_job

__all__ = ["ClickLog", "PSConfig", "PSError", "auc", "run_ps_job"]
