"""The single-process baseline a synchronous parameter server must equal: plain torch on the global batch.

Same initial model (same seed), same global batch per step (the W workers' batches concatenated in
worker order), mean loss over it, torch's own optimizers on sparse embedding gradients: SGD and Adagrad
for every parameter, or SparseAdam for the two tables plus Adam for the dense ones.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tessera.models.ctr import SPARSE_TABLES
from tessera.parameter_server.config import PSConfig
from tessera.parameter_server.worker import build_model, click_log, evaluate


def _optimizers(model, cfg: PSConfig) -> list[torch.optim.Optimizer]:
    params = list(model.parameters())
    if cfg.optimizer == "sgd":
        return [torch.optim.SGD(params, lr=cfg.lr)]
    if cfg.optimizer == "adagrad":
        return [torch.optim.Adagrad(params, lr=cfg.lr)]
    named = dict(model.named_parameters())
    sparse = [named[n] for n in SPARSE_TABLES]
    dense = [p for n, p in named.items() if n not in SPARSE_TABLES]
    return [torch.optim.SparseAdam(sparse, lr=cfg.lr), torch.optim.Adam(dense, lr=cfg.lr)]


def train_single_process(cfg: PSConfig, steps: int, seed: int = 0) -> dict:
    """Train on the global batch in one process; returns params, per-step losses, the final AUC and the
    seconds of the training loop alone (``loop_seconds``: as the PS workers' clock counts them)."""
    model = build_model(cfg, seed, sparse=True)
    data = click_log(cfg, seed)
    opts = _optimizers(model, cfg)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        parts = [data.batch(step, w, cfg.batch_size) for w in range(cfg.workers)]
        fields_BF = torch.cat([f for f, _ in parts])
        labels_B = torch.cat([y for _, y in parts])
        loss = F.binary_cross_entropy_with_logits(model(fields_BF), labels_B)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in opts:
            opt.step()
        losses.append(loss.item())
    loop_seconds = time.perf_counter() - start
    score, ceiling = evaluate(model, cfg, seed)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": losses,
            "auc": score, "ceiling_auc": ceiling, "loop_seconds": loop_seconds}
