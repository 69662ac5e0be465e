"""``[ps]``: the parameter-server job (roles, consistency, optimizer, the CTR model's shape)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError
from tessera.models.ctr import CTRConfig

MODES = ("bsp", "asp", "ssp")
OPTIMIZERS = ("sgd", "adagrad", "adam")


@dataclass
class PSConfig:
    servers: int = 2  # server processes; each owns a hash partition of every sparse table's rows
    workers: int = 2  # worker processes; each pulls the rows its batch touches and pushes their gradients
    mode: str = "bsp"  # "bsp" (one averaged update per step), "asp" (apply each push) or "ssp" (bounded)
    staleness: int = 2  # ssp only: no worker may start step t before every worker finished step t - staleness - 1
    address: str = "127.0.0.1"  # where the RPC listeners and the rendezvous store listen: loopback by default
    port: int = 0  # the rendezvous store's port; 0 picks a free one
    optimizer: str = "adagrad"  # the servers' row-wise optimizer: "sgd", "adagrad" or "adam"
    lr: float = 0.05  # the servers' learning rate
    batch_size: int = 256  # samples per worker per step (the global batch is workers × batch_size)
    fields: int = 8  # CTR model: categorical fields per sample
    buckets: int = 1000  # CTR model: hash buckets (table rows) per field
    embed_dim: int = 8  # CTR model: deep embedding width
    hidden: int = 32  # CTR model: hidden MLP width
    eval_size: int = 4096  # held-out samples for the AUC at the end
    timeout: float = 30.0  # seconds any RPC or server wait may take before the job stops with an error
    save_every: int = 0  # save every server's tables and optimizer state every this many steps (0: only at the end)
    resume: str = ""  # a folder of saved tables to resume from (empty: start fresh)

    def validate(self) -> PSConfig:
        for key in ("servers", "workers", "batch_size", "eval_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"ps.{key} must be at least 1, got {getattr(self, key)}")
        if self.mode not in MODES:
            raise ConfigError(f"ps.mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"ps.optimizer must be one of {', '.join(OPTIMIZERS)}, got '{self.optimizer}'")
        if self.staleness < 0 or self.save_every < 0 or not 0 <= self.port < 65536:
            raise ConfigError("ps.staleness and ps.save_every must be non-negative and ps.port in [0, 65535]")
        if self.lr <= 0 or self.timeout <= 0:
            raise ConfigError(f"ps.lr and ps.timeout must be positive, got {self.lr} and {self.timeout}")
        self.ctr().validate()
        # no network look-up here (every job validates [ps]): the address is checked against this
        # machine's interfaces by the job that listens on it (parameter_server.network.listen_interface)
        return self

    def ctr(self) -> CTRConfig:
        return CTRConfig(n_fields=self.fields, buckets=self.buckets, embed_dim=self.embed_dim, hidden=self.hidden)
