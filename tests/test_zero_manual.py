"""ZeRO-3 in manual mode, the way a pipeline drives it: two ranks (and 2 × 2 hybrid sharding), each
running several micro-batches through two "stages" of a holder module whose root is never called
(embedding + block 0, then block 1 + the root's final norm + head), reducing once per step with
``reduce_gradients()``. Equals one process (fp32), with both ``reshard_after_forward`` settings, and
issues exactly the collectives the mode promises per step (counted by the CommLedger).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm.ledger import CommLedger
from tessera.models import Transformer, model_config
from tessera.models.layers import TransformerBlock
from tessera.precision import PrecisionConfig
from tessera.topology import ParallelConfig, Topology
from tessera.zero import ZeroConfig
from tessera.zero.build import shard_model
from tolerance import ADAM_EPS, assert_close_but_few

GLOBAL_BATCH, MICRO, SEQ, STEPS, LR, CLIP = 8, 2, 16, 3, 1e-2, 0.5
CPU = torch.device("cpu")


def make_model():
    torch.manual_seed(0)
    return Transformer(model_config("tiny", n_layers=2))


def holder_of(model):
    """A pipeline rank's holder: the modules of its stages, shared with ``model``; never called itself."""
    holder = nn.Module()
    holder.tok_embeddings, holder.layers, holder.norm, holder.output = (model.tok_embeddings, model.layers,
                                                                        model.norm, model.output)
    return holder


def param_groups(module):
    ps = list(module.parameters())
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(groups):
    return torch.optim.AdamW(groups, lr=LR, eps=ADAM_EPS)


def micro_batches(step, rank, world):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    x = x[rank * per : (rank + 1) * per]
    size = GLOBAL_BATCH // (world * MICRO)  # sequences per micro-batch: MICRO of them on each rank
    return list(zip(x[:, :-1].split(size), x[:, 1:].split(size)))


def run_step(model, holder, batches):
    """GPipe order on one rank holding two stages: every forward, then every backward (last first).
    Returns the summed token loss of these micro-batches divided by the global token count."""
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    tokens = GLOBAL_BATCH * SEQ
    saved, total = [], 0.0
    for x, y in batches:
        act_a = holder.layers["0"](holder.tok_embeddings(x), cos, sin)
        act_in = act_a.detach().requires_grad_()  # what the next stage receives
        logits = holder.output(holder.norm(holder.layers["1"](act_in, cos, sin)))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / tokens
        saved.append((act_a, act_in, loss))
        total += float(loss.detach())
    for act_a, act_in, loss in reversed(saved):
        loss.backward()  # stage B's backward
        act_a.backward(act_in.grad)  # stage A's backward, with the gradient stage B sent back
    return total


def single_process():
    model = make_model()
    opt = make_optimizer(param_groups(model))
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(run_step(model, holder_of(model), micro_batches(step, 0, 1)))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def counts(stats):
    out = {"all_gather": 0, "reduce_scatter": 0}
    for (_, op), stat in stats.items():
        if op in out:
            out[op] += stat.count
    return out


def manual_worker(rank, world_size, reshard, replicate=None):
    """``replicate``: hybrid sharding (shard over dp_shard = world / replicate, then all-reduce slices over
    dp_replicate); None: shard over every rank."""
    ledger = CommLedger()
    shards = world_size // replicate if replicate else 1
    topo = Topology.build(ParallelConfig(dp_replicate=replicate or world_size, dp_shard=shards), ledger)
    try:
        dp = topo.group("dp")
        model = make_model()
        holder = holder_of(model)
        engine = shard_model(holder, param_groups(holder), make_optimizer, topo, 3,
                             ZeroConfig(reshard_after_forward=reshard), PrecisionConfig(), CPU,
                             block_class=TransformerBlock, manual=True)
        losses, norms, windows, held = [], [], [], []
        for step in range(STEPS):
            mark = ledger.stats()
            loss = torch.tensor(run_step(model, holder, micro_batches(step, dp.rank, dp.size)), dtype=torch.float64)
            after_backward = ledger.stats()
            held.append([f.gathered for f in engine.flats])
            engine.reduce_gradients()
            windows.append((counts(ledger.since(mark)), counts(ledger.since(after_backward))))
            assert not any(f.gathered or f.full.grad is not None for f in engine.flats)
            comm.all_reduce(loss, dp)
            losses.append(float(loss))
            norms.append(engine.clip_grad_norm(CLIP)[0])
            engine.step()
            engine.zero_grad()
        layout = [(u is engine.units[0], len(u.flats)) for u in engine.units]
        return losses, norms, engine.full_state(), windows, held, layout
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("world, reshard, replicate", [(2, True, None), (2, False, None), (4, True, 2)])
def test_manual_zero3_matches_single_process(rank_pool, world, reshard, replicate):
    ref_losses, ref_norms, ref_params = single_process()
    results = rank_pool.run(manual_worker, world, reshard=reshard, replicate=replicate)
    for losses, norms, params, *_ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert norms == pytest.approx(ref_norms, rel=1e-4)
        for name, value in params.items():
            assert_close_but_few(value, ref_params[name], rtol=1e-4, atol=1e-5, loose_atol=2 * LR * STEPS, msg=name)


@pytest.mark.multirank
@pytest.mark.parametrize("reshard", [True, False])
def test_manual_zero3_gathers_and_reduces_as_promised(rank_pool, reshard):
    """Per step: no reduce-scatter during the backwards and one per flat in reduce_gradients; all-gathers
    2·m per flat of a non-root unit with reshard_after_forward (forward and backward of every
    micro-batch) plus 1 for each root flat (gathered at first use, kept), or 1 per flat without."""
    (_, _, _, windows, held, layout) = rank_pool.run(manual_worker, 2, reshard=reshard)[0]
    flats = sum(n for _, n in layout)
    root = sum(n for is_root, n in layout if is_root)
    gathers = (2 * MICRO * (flats - root) + root) if reshard else flats
    assert len(layout) == 5 and root == 1  # embedding, two blocks, head; the root holds the final norm
    for whole, reduction in windows:
        assert whole == {"all_gather": gathers, "reduce_scatter": flats}
        assert reduction == {"all_gather": 0, "reduce_scatter": flats}
    # after the step's backwards: only the root is still gathered, or every unit when none is resharded
    for gathered in held:
        assert sum(gathered) == (root if reshard else flats)
