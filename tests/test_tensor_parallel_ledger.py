"""CommLedger volumes of Megatron 1D tensor parallelism, per layer and micro-batch, against the formulas.

Per layer: 2 all-reduces of b·s·h in forward and 2 in backward; under sequence parallelism the same
bytes as 2 all-gathers + 2 reduce-scatters each way, plus, in backward, 2 all-gathers that rebuild the
regions' inputs (only their sequence slices were saved). The per-layer figure is the difference between a
3-layer and a 1-layer model, halved, so embedding, head and loss traffic cancel out.
"""

import pytest
import torch

from tessera.comm import CommLedger
from tessera.models import Transformer, model_config
from tessera.tensor_parallel import TensorParallelConfig, TensorParallelLoss, apply_tensor_parallel, volumes
from tessera.topology import ParallelConfig, Topology

B, S, DIM, VOCAB = 2, 16, 32, 96


def phases(model, tp, ledger):
    """Ledger differences of the forward (model only) and the backward of one micro-batch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (B, S + 1), generator=g)
    before = ledger.stats()
    logits = model(x[:, :-1])
    fwd = ledger.since(before)
    s, n = TensorParallelLoss(tp)(logits, x[:, 1:])
    before = ledger.stats()
    (s / n).backward()
    bwd = ledger.since(before)
    as_dict = lambda st: {op: (v.count, v.bytes, v.wire_bytes) for (axis, op), v in st.items() if axis == "tp"}
    return {"fwd": as_dict(fwd), "bwd": as_dict(bwd)}


def ledger_worker(rank, world_size, sp):
    ledger = CommLedger()
    topo = Topology.build(ParallelConfig(tp=world_size), ledger)
    try:
        tp = topo.group("tp")
        out = {}
        for layers in (1, 3):
            torch.manual_seed(0)
            model = Transformer(model_config("tiny", vocab_size=VOCAB, dim=DIM, n_layers=layers))
            apply_tensor_parallel(model, tp, TensorParallelConfig(sequence_parallel=sp))
            out[layers] = phases(model, tp, ledger)
        return out
    finally:
        topo.destroy()


def per_layer(out, phase):
    """(count, bytes, wire) per op for one layer: (3 layers − 1 layer) / 2."""
    big, small = out[3][phase], out[1][phase]
    return {op: tuple((a - b) / 2 for a, b in zip(big[op], small.get(op, (0, 0, 0)))) for op in big
            if big[op] != small.get(op)}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_tp_ledger_volume_per_layer(rank_pool, sp):
    n = 2
    outs = rank_pool.run(ledger_worker, n, sp=sp)
    act = B * S * DIM * 4  # b·s·h fp32 bytes
    want = volumes.megatron_1d_layer(B, S, DIM, sequence_parallel=sp)
    for out in outs:
        fwd, bwd = per_layer(out, "fwd"), per_layer(out, "bwd")
        assert {op: v[1] for op, v in fwd.items()} == want
        assert all(v[0] == 2 for v in fwd.values())
        wire_fwd = sum(v[2] for v in fwd.values())
        assert wire_fwd == pytest.approx(2 * 2 * (n - 1) / n * act)  # two ring all-reduces' worth
        want_bwd = volumes.megatron_1d_layer(B, S, DIM, sequence_parallel=sp, backward=True)
        if sp:  # plus the all-reduce of the two norm weights' gradients (h floats each)
            want_bwd["all_reduce"] = 2 * DIM * 4
        assert {op: v[1] for op, v in bwd.items()} == want_bwd
        # the whole-model forward: the layers, the embedding's reduction, nothing for the head
        total = {op: v[1] for op, v in out[3]["fwd"].items()}
        key = "reduce_scatter" if sp else "all_reduce"
        assert total[key] == 3 * want[key] + act
