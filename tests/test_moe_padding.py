"""Padding is routed nowhere: a padded batch through an MoE model trains as its rows would unpadded.

Padding (a row's tail of ignored targets: fine-tuning examples, length bucketing) would otherwise take
expert capacity, weigh in the balance and z losses and in the expert-load metrics, so the loss of real
tokens would depend on how much padding shares their micro-batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.comm.group import CommGroup
from tessera.models import Transformer, cross_entropy_sum, moe_loss_sum
from tessera.models.config import model_config
from tessera.models.moe import MoEConfig, Router, collect_local_stats
from tessera.models.moe_tokens import real_tokens
from tessera.train.step import IGNORE_INDEX, counted_targets, forward_backward

from test_bucketing import padded_sft_step
from test_sft import pairs, prepared

SEQ, E = 32, 4


def test_real_tokens_are_all_but_the_tail_of_ignored_targets():
    y = torch.tensor([[-100, -100, 5, 6, -100, -100], [1, 2, 3, 4, 5, 6], [-100, 7, -100, 8, -100, -100]])
    assert real_tokens(counted_targets(y)).tolist() == [[True] * 4 + [False] * 2, [True] * 6,
                                                         [True] * 4 + [False] * 2]
    assert counted_targets(y[1:2]) is None  # every target counts: no mask at all


@pytest.mark.parametrize("top_k", [1, 2])
def test_router_with_padding_equals_the_real_tokens_alone(top_k):
    """Capacity (binding here), slots, aux, z and every counter of a group with padding are those of its
    real tokens routed alone; padding keeps no slot."""
    torch.manual_seed(0)
    router = Router(16, E, MoEConfig(top_k=top_k, capacity_factor=0.5, min_capacity=0))
    x_TD = torch.randn(40, 16)  # 4 rows of 10: prompts (uncounted) at the start, padding at the end
    counted_BS = torch.zeros(4, 10, dtype=torch.bool)
    for b, (start, end) in enumerate([(2, 7), (0, 10), (4, 5), (1, 9)]):
        counted_BS[b, start:end] = True
    valid_T = real_tokens(counted_BS).reshape(-1)
    assert valid_T.sum() == 31  # the prompts stay, the tails go
    got, alone = router(x_TD, 4, counted_T=counted_BS.reshape(-1)), router(x_TD[valid_T])
    assert alone.dropped > 0  # capacity binds: the slot order matters
    assert (got.capacity, got.tokens, got.dropped) == (alone.capacity, alone.tokens, alone.dropped)
    assert torch.equal(got.keep_TK[valid_T], alone.keep_TK) and not got.keep_TK[~valid_T].any()
    assert torch.equal(got.expert_TK[valid_T], alone.expert_TK)
    assert torch.equal(got.kept_E, alone.kept_E) and torch.equal(got.routed_E, alone.routed_E)
    torch.testing.assert_close(got.aux_loss, alone.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.z_loss, alone.z_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("batch", [1, 4])
def test_real_tokens_counted_on_the_host_equal_the_routed_count(batch):
    """The host's count of a group's real tokens (no wait for the device) is the router's own count."""
    from tessera.models.moe import _real_count
    from tessera.models.moe_tokens import route_padding_nowhere

    torch.manual_seed(1)
    counted_T = torch.rand(40) < 0.6
    shifted_GK = torch.randint(0, E, (40, 2)) + (E + 1) * counted_T.logical_not().long()[:, None]
    _, real_G = route_padding_nowhere(shifted_GK, batch, E)
    assert _real_count(real_G, counted_T, batch, whole_group=True) == int(real_G.sum())


def test_moe_layers_found_once_key_and_mark_as_the_model_walk():
    """``MoELayers`` (found once) keys the noise with the block indices the model walk gives, and marks
    and collects the same layers."""
    from tessera.models.moe import MoELayers, key_tokens, mark_padding, moe_layers

    model = Transformer(model_config("tiny", vocab_size=64, num_experts=E, moe_every=2), MoEConfig())
    found = MoELayers(model)
    assert list(found) == moe_layers(model) and len(found) > 0
    key_tokens(model, 7, 3)
    walked = [(layer.token_key.layer, layer.token_key.first_row) for layer in found]
    key_tokens(found, 7, 3)
    assert [(layer.token_key.layer, layer.token_key.first_row) for layer in found] == walked
    mask = torch.ones(2, SEQ, dtype=torch.bool)
    mark_padding(found, mask)
    assert all(layer.counted_BS is mask for layer in moe_layers(model))
    assert moe_loss_sum(found) == 0.0  # nothing pending before a training forward


def test_padded_moe_step_equals_its_rows_unpadded(tmp_path):
    """One bucketed fine-tuning step (padded rows, prompts) through an MoE transformer: its loss, gradients
    and routing counters equal those of its rows run one by one, unpadded. No capacity and no balance
    loss (neither adds up over routing groups); the z-loss does, and padding would add to it."""
    ex, rows, ids, batches = padded_sft_step(tmp_path)
    assert sum(int(real_tokens(y != IGNORE_INDEX).logical_not().sum()) for _, y in batches) > 8  # padding to leak
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", vocab_size=256, dropout=0.0, num_experts=E, moe_every=1),
                        MoEConfig(top_k=2, drop_tokens=False, aux_loss_coef=0.0, z_loss_coef=0.1))
    result = forward_backward(model, batches, CommGroup.single("dp"), torch.device("cpu"))
    grads = [p.grad.clone() for p in model.parameters()]
    counters = collect_local_stats(model)
    model.zero_grad()
    total, ce, count = torch.zeros((), dtype=torch.float64), 0.0, 0
    for i in ids:  # each row alone, exactly its tokens
        doc = torch.as_tensor(np.asarray(ex.tokens[rows.start[i]:rows.start[i] + rows.length[i]], np.int64))
        y = doc[1:].clone()
        y[:max(int(rows.counted_from[i]) - 1, 0)] = IGNORE_INDEX  # the prompt's targets
        s, n = cross_entropy_sum(model(doc[None, :-1]), y[None], ignore_index=IGNORE_INDEX)
        total, ce, count = total + s.double() + moe_loss_sum(model), ce + float(s.detach()), count + int(n)
    (total / count).backward()
    alone = collect_local_stats(model)
    assert result.tokens == count and result.loss == pytest.approx(ce / count, rel=1e-6)
    for g, p in zip(grads, model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(counters[:, :-2], alone[:, :-2], rtol=0, atol=0)  # kept, routed, tokens
    torch.testing.assert_close(counters[:, -1], alone[:, -1], rtol=1e-5, atol=0)  # z·T


# ---------------------------------------------------------------- the trainer, bucketed fine-tuning data

MOE = ["--model.num_experts=4", "--model.moe_every=1", "--moe.top_k=2", "--moe.capacity_factor=1.0",
       "--moe.min_capacity=0", "--model.n_layers=2", "--data.micro_batch_size=2", "--data.bucketing=length",
       "--checkpoint.save_final=false"]


@pytest.fixture(scope="module")
def moe_sft(tmp_path_factory):
    """(prepared SFT folder, the one-process bucketed MoE run's losses at bucket_multiple 8), made once."""
    from tessera.launch import run_rank
    from tessera.train.config import load_config

    from test_sft import train_args, train_losses

    out = tmp_path_factory.mktemp("moe_padding")
    data = prepared(out, "sft", pairs(40), val_fraction=0.25)[1]
    run_rank(load_config(None, train_args(out, data, "one", extra=[*MOE, "--data.bucket_multiple=8"])))
    return data, train_losses(out / "one")


def test_bucketed_moe_losses_do_not_depend_on_the_padding(tmp_path, moe_sft):
    """The same rows padded to multiples of 2 instead of 8 (capacity binding, balance and z losses on): the
    same losses, as the padding is routed nowhere."""
    from tessera.launch import run_rank
    from tessera.train.config import load_config

    from test_sft import train_args, train_losses

    data, want = moe_sft
    run_rank(load_config(None, train_args(tmp_path, data, "two", extra=[*MOE, "--data.bucket_multiple=2"])))
    got = train_losses(tmp_path / "two")
    assert len(want) == 4 and np.allclose(got, want, rtol=1e-6, atol=0), (want, got)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [["--parallel.dp_replicate=2"], ["--parallel.ep=2"], ["--parallel.cp=2"]],
                         ids=["dp2", "ep2", "cp2"])
def test_bucketed_moe_fine_tuning_matches_single_process(rank_pool, tmp_path, moe_sft, layout):
    """dp2, ep2 and cp2 (each rank holding zig-zag chunks of rows with prompts and padding, padded to
    multiples of 4) train the bucketed MoE fine-tuning run as one process does (4 losses, rel 1e-5)."""
    from test_sft import sft_trainer_worker, train_args, train_losses

    data, want = moe_sft
    rank_pool.run(sft_trainer_worker, 2, args=train_args(tmp_path, data, "n",
                                                         extra=[*MOE, "--data.bucket_multiple=2", *layout]))
    got = train_losses(tmp_path / "n")
    assert np.allclose(got, want, rtol=1e-5, atol=0), (want, got)


def cp_padding_worker(rank, world_size):
    """One router over cp ranks against one process, on rows whose padding and prompt fill whole chunks."""
    from tessera import comm
    from tessera.context_parallel import shard_sequence
    from tessera.context_parallel.moe_routing import ContextParallelRouter, group_rows
    from tessera.topology import ParallelConfig, Topology

    topo = Topology.build(ParallelConfig(cp=world_size))
    try:
        cp, (b, s, d) = topo.group("cp"), (2, 16, 8)
        torch.manual_seed(0)
        router = Router(d, E, MoEConfig(top_k=2, capacity_factor=0.5, min_capacity=0))
        x_BSD = torch.randn(b, s, d, generator=torch.Generator().manual_seed(3))
        counted_BS = torch.ones(b, s, dtype=torch.bool)
        counted_BS[0, :6] = False  # a prompt: rank 0's first chunk (0-3) holds prompt only ...
        counted_BS[0, 10:] = False  # ... and its last chunk (12-15) padding only
        whole = router(x_BSD.reshape(-1, d), b, counted_T=counted_BS.reshape(-1))
        sharded = ContextParallelRouter(router, cp)
        mine = group_rows(b, s // cp.size, cp.size)[cp.rank]
        got = sharded(shard_sequence(x_BSD, cp).reshape(-1, d), b,
                      counted_T=shard_sequence(counted_BS, cp).reshape(-1))
        shares = torch.stack([got.aux_loss, got.z_loss]).detach()
        comm.all_reduce(shares, cp)
        return {"keep": torch.equal(got.keep_TK, whole.keep_TK[mine]), "valid": torch.equal(got.valid_T,
                whole.valid_T[mine]), "tokens": (got.tokens, whole.tokens), "capacity": (got.capacity, whole.capacity),
                "shares": shares.tolist(), "whole": [float(whole.aux_loss), float(whole.z_loss)],
                "dropped": whole.dropped}
    finally:
        topo.destroy()


@pytest.mark.multirank
def test_padding_over_cp_is_decided_for_the_whole_row(rank_pool):
    """cp2: a rank holding only prompt and padding chunks of a row keeps the prompt (a token is padding by
    the targets of its whole row); capacity, slots, aux and z are one process's."""
    for r in rank_pool.run(cp_padding_worker, 2):
        assert r["dropped"] > 0 and r["tokens"][1] == 2 * 16 - 6  # capacity binds; 6 padding tokens
        assert r["keep"] and r["valid"] and r["tokens"][0] == r["tokens"][1] and r["capacity"][0] == r["capacity"][1]
        assert r["shares"] == pytest.approx(r["whole"], rel=1e-6)
