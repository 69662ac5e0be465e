"""Context parallelism trains a sequence whose activations do not fit one rank's stated budget.

The instrument is the MemoryLedger's count of the bytes autograd saves for backward (distinct storages,
parameters excluded), taken per rank over one training forward. The dense model on one process at
S = 512 saves more than BUDGET_BYTES; under cp = 4 every rank saves less than BUDGET_BYTES, and the
loss and gradients still equal the dense model's. Run with `-s` to print the table the docs quote.
"""

import pytest
import torch

from tessera import comm
from tessera.comm import CommGroup
from tessera.context_parallel import ContextParallelConfig, apply_context_parallel, shard_sequence
from tessera.models import Transformer, cross_entropy_sum, model_config
from tessera.topology import ParallelConfig, Topology
from tessera.train.memory import storage_key

SEQ, CP = 512, 4
MODEL = dict(dim=64, n_heads=8, n_kv_heads=4, ffn_hidden_dim=96, max_seq_len=SEQ)
BUDGET_BYTES = 2 * 2**20  # the stated per-rank budget for saved activations: 2 MiB


def _batch():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (1, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _measure(model, x, y, n_tokens, cp: CommGroup):
    """(saved-activation bytes of the whole forward, of the attention cores alone, loss sum, grads).

    Counted as MemoryLedger.track_activations counts (distinct storages, parameters excluded); one
    pack hook does both counts because only the innermost saved-tensors hook would run."""
    params = {storage_key(p) for p in model.parameters()}
    in_core = [False]
    saved: dict = {}
    core_saved: dict = {}

    def pack(t):
        key = storage_key(t)
        if key not in params:
            saved.setdefault(key, t.untyped_storage().nbytes())
            if in_core[0]:
                core_saved.setdefault(key, t.untyped_storage().nbytes())
        return t

    for attn in (m for m in model.modules() if hasattr(m, "core_attention")):
        attn.core_attention.register_forward_pre_hook(lambda *a: in_core.__setitem__(0, True))
        attn.core_attention.register_forward_hook(lambda *a: in_core.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_sum, _ = cross_entropy_sum(model(x), y)
    (loss_sum / n_tokens).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():  # cp-replicated parameters: their gradients are summed over cp
        comm.all_reduce(g, cp)
    return sum(saved.values()), sum(core_saved.values()), float(loss_sum.detach()), grads


def _model():
    torch.manual_seed(0)
    return Transformer(model_config("tiny", **MODEL))


def memory_worker(rank, world_size, method):
    topo = Topology.build(ParallelConfig(cp=world_size))
    try:
        cp = topo.group("cp")
        model = apply_context_parallel(_model(), cp, ContextParallelConfig(method))
        x, y = _batch()
        total, core, loss_sum, grads = _measure(model, shard_sequence(x, cp), shard_sequence(y, cp), SEQ, cp)
        loss = torch.tensor(loss_sum, dtype=torch.float64)
        comm.all_reduce(loss, cp)
        return {"total": total, "core": core, "loss": float(loss) / SEQ, "grads": grads}
    finally:
        topo.destroy()


@pytest.mark.multirank
def test_context_parallel_trains_a_sequence_over_one_ranks_budget(rank_pool):
    x, y = _batch()
    dense_total, dense_core, dense_loss_sum, dense_grads = _measure(_model(), x, y, SEQ, CommGroup.single("cp"))
    assert dense_total > BUDGET_BYTES  # one rank cannot hold this sequence's activations
    rows = [("dense, 1 rank", dense_total, dense_core)]
    for method in ("ring", "ulysses", "ring_self_attention"):
        results = rank_pool.run(memory_worker, CP, method=method)
        for r in results:
            torch.testing.assert_close(r["loss"], dense_loss_sum / SEQ, rtol=1e-6, atol=1e-6)
            for name, g in dense_grads.items():
                torch.testing.assert_close(r["grads"][name], g, rtol=1e-4, atol=1e-6)
        worst = max(results, key=lambda r: r["total"])
        rows.append((f"{method}, cp={CP}, max over ranks", worst["total"], worst["core"]))
        if method != "ring_self_attention":  # it saves the [S/cp, S] score rows: the paper's O(S²/cp)
            assert all(r["total"] <= BUDGET_BYTES for r in results), (method, [r["total"] for r in results])
    print(f"\nsaved activations per rank, S={SEQ}, B=1, {MODEL}, budget {BUDGET_BYTES / 2**20:.1f} MiB")
    for label, total, core in rows:
        print(f"  {label:40s} total {total / 2**20:7.2f} MiB   attention core {core / 2**20:7.2f} MiB")
