"""Context parallelism composed with Megatron tensor parallelism: tp = 2 × cp = 2 on 4 ranks.

Order as in parallelize: tensor parallel first (heads split over tp), then context parallel (each
tp rank's attention core, on its heads, made distributed over cp). Losses and gradients equal the
dense single-process model's.
"""

import pytest
import torch

from tessera import comm
from tessera.context_parallel import ContextParallelConfig, apply_context_parallel, shard_sequence
from tessera.models import Transformer, cross_entropy_sum, model_config
from tessera.tensor_parallel import TensorParallelConfig, TensorParallelLoss, apply_tensor_parallel
from tessera.topology import ParallelConfig, Topology

BATCH, SEQ, STEPS = 2, 32, 2
MODEL = dict(dim=64, n_heads=8, n_kv_heads=4, ffn_hidden_dim=96, max_seq_len=64)


def make_model():
    torch.manual_seed(0)
    return Transformer(model_config("tiny", **MODEL))


def global_batch(step: int):
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train(model, loss_fn, cp=None):
    """AdamW steps on the global-mean token loss; the losses, the gradients of step 0."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = global_batch(step)
        if cp is not None:
            x, y = shard_sequence(x, cp), shard_sequence(y, cp)
        s, _ = loss_fn(model(x), y)
        (s / (BATCH * SEQ)).backward()  # every token counts: the global count is B·S
        loss = s.detach().double()
        if cp is not None:  # sum the context chunks' losses and gradients over cp
            comm.all_reduce(loss, cp)
            for p in model.parameters():
                comm.all_reduce(p.grad, cp)
        losses.append(float(loss) / (BATCH * SEQ))
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def tp_cp_worker(rank, world_size, method, sp):
    topo = Topology.build(ParallelConfig(tp=2, cp=2))
    try:
        tp, cp = topo.group("tp"), topo.group("cp")
        model = apply_tensor_parallel(make_model(), tp, TensorParallelConfig(sequence_parallel=sp))
        model = apply_context_parallel(model, cp, ContextParallelConfig(method))
        losses, grads = train(model, TensorParallelLoss(tp), cp)
        return {"losses": losses, "grads": grads, "tp": topo.coord("tp"), "cp": topo.coord("cp")}
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_composes_with_tensor_parallel(rank_pool, method, sp):
    ref_losses, ref_grads = train(make_model(), cross_entropy_sum)
    outs = rank_pool.run(tp_cp_worker, 4, method=method, sp=sp)
    for o in outs:
        torch.testing.assert_close(o["losses"], ref_losses, rtol=1e-6, atol=1e-6)
    for c in range(2):
        by_tp = sorted((o for o in outs if o["cp"] == c), key=lambda o: o["tp"])
        for name, g in ref_grads.items():
            shards = [o["grads"][name] for o in by_tp]
            if shards[0].shape != g.shape:  # split over tp: concatenate along the split dimension
                dim = next(d for d in range(g.dim()) if shards[0].shape[d] != g.shape[d])
                shards = [torch.cat(shards, dim=dim)]
            torch.testing.assert_close(shards[0], g, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"cp {c} gradient of {n}: {m}")
