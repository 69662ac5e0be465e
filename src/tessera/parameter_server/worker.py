"""A worker's training loop: pull the rows its batch touches, run the wide & deep head, push sparse gradients.

Per step t, worker w draws batch (t, w) of ``ps.batch_size`` samples, de-duplicates its rows (U unique
rows of B·F), pulls those rows and every dense tensor, computes the loss summed over its samples and
divided by the global batch W·B (so the W pushes sum to the global mean gradient), and pushes.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from tessera.models.ctr import SPARSE_TABLES, WideDeep, dense_names
from tessera.parameter_server.client import PSClient
from tessera.parameter_server.clicklog import ClickLog, auc
from tessera.parameter_server.config import PSConfig


def build_model(cfg: PSConfig, seed: int, sparse: bool = False) -> WideDeep:
    """The initial model every role builds identically from the seed."""
    torch.manual_seed(seed)
    return WideDeep(cfg.ctr(), sparse=sparse)


def click_log(cfg: PSConfig, seed: int) -> ClickLog:
    return ClickLog(cfg.fields, cfg.buckets, seed=seed)


def worker_step(model: WideDeep, client: PSClient, fields_BF: torch.Tensor, labels_B: torch.Tensor,
                step: int, global_batch: int) -> float:
    rows_U, inv_BF = torch.unique(model.rows(fields_BF), return_inverse=True)
    pulled = client.pull(step, rows_U)
    names = dense_names(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].copy_(pulled[n].view_as(params[n]))
    embed_UD = pulled["embed.weight"].requires_grad_()
    wide_U1 = pulled["wide.weight"].requires_grad_()
    logits_B = model.head(embed_UD[inv_BF], wide_U1[inv_BF].squeeze(-1))
    loss = F.binary_cross_entropy_with_logits(logits_B, labels_B, reduction="sum") / global_batch
    model.zero_grad(set_to_none=True)
    loss.backward()
    client.push(step, rows_U, {"embed.weight": embed_UD.grad, "wide.weight": wide_U1.grad},
                {n: params[n].grad for n in names})
    return loss.item() * global_batch / len(labels_B)  # this worker's mean loss


def assemble(model: WideDeep, shards: list[dict[str, torch.Tensor]], servers: int) -> dict[str, torch.Tensor]:
    """The servers' shards → a full state dict of ``model``."""
    state = {}
    for name, param in model.named_parameters():
        if name in SPARSE_TABLES:
            full = torch.empty_like(param)
            for s, shard in enumerate(shards):
                full[s::servers] = shard[name]
            state[name] = full
        else:
            state[name] = next(sh[name] for sh in shards if name in sh).view_as(param).clone()
    return state


def evaluate(model: WideDeep, cfg: PSConfig, seed: int) -> tuple[float, float]:
    """(model AUC, planted-model ceiling AUC) on the held-out set."""
    fields, labels, ceiling = click_log(cfg, seed).eval_set(cfg.eval_size)
    with torch.no_grad():
        return auc(model(fields), labels), ceiling


def worker_main(worker: int, cfg: PSConfig, steps: int, seed: int, report: Callable[[int, float], None],
                slow: float = 0.0, want_params: bool = False) -> dict:
    model = build_model(cfg, seed)
    data = click_log(cfg, seed)
    client = PSClient(worker, cfg, dense_names(model))
    start = client.start_step()
    t0 = time.perf_counter()
    for step in range(start, steps):
        fields, labels = data.batch(step, worker, cfg.batch_size)
        loss = worker_step(model, client, fields, labels, step, cfg.workers * cfg.batch_size)
        report(step, loss)
        if slow:
            time.sleep(slow)  # a deliberately slow worker (tests of the SSP bound)
    seconds = time.perf_counter() - t0
    out = {"worker": worker, "start_step": start, "seconds": seconds, "server_bytes": client.server_bytes,
           "ledger": client.ledger.as_dict(client.ledger.stats())}
    if worker == 0:  # worker 0 reports the final model, its AUC and the servers' statistics
        finals = client.final_state(steps)
        state = assemble(model, [f[0] for f in finals], cfg.servers)
        model.load_state_dict(state)
        out["auc"], out["ceiling_auc"] = evaluate(model, cfg, seed)
        out["staleness"] = [f[1] for f in finals]
        out["max_gap"] = max(f[2] for f in finals)
        out["versions"] = [f[3] for f in finals]
        if want_params:
            out["params"] = state
    return out
