"""Saved activations per layer under TP, TP+SP and selective recomputation (Korthikanti et al. 2022).

The paper's structure, which these measurements must follow exactly: with tp = t, the activations inside
the tensor-parallel regions shrink by t, the rest (norm and dropout regions) does not; sequence
parallelism divides everything by t; selective recomputation removes the attention core's a·s² term
(softmax output, its dropout mask and output: 3 fp32 tensors of b·a·s² here, 5 bytes in the paper's fp16).
"""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tessera.models import Transformer, model_config
from tessera.tensor_parallel import TensorParallelConfig, apply_tensor_parallel
from tessera.topology import ParallelConfig, Topology
from tessera.train.memory import MemoryLedger

SHAPE = dict(dim=32, n_heads=4, n_kv_heads=4, ffn_hidden_dim=128, vocab_size=64, max_seq_len=32, dropout=0.1)
B, S = 2, 32
VARIANTS = {
    "none": None,
    "tp": TensorParallelConfig(),
    "tp_sp": TensorParallelConfig(sequence_parallel=True),
    "tp_sp_selective": TensorParallelConfig(sequence_parallel=True, recompute_core_attention=True),
}


def per_layer_saved(tp, cfg) -> int:
    """(saved bytes of a 3-layer forward − a 1-layer forward) / 2: embedding, head and loss cancel."""
    tokens = torch.randint(0, SHAPE["vocab_size"], (B, S), generator=torch.Generator().manual_seed(0))
    sizes = []
    for layers in (1, 3):
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", n_layers=layers, **SHAPE))
        if cfg is not None:
            apply_tensor_parallel(model, tp, cfg)
        ledger = MemoryLedger(model)
        with sdpa_kernel([SDPBackend.MATH]), ledger.track_activations():  # materialise softmax like the paper
            model(tokens)
        sizes.append(ledger.activation_bytes)
    return (sizes[1] - sizes[0]) // 2


def memory_worker(rank, world_size):
    topo = Topology.build(ParallelConfig(tp=world_size))
    try:
        return {name: per_layer_saved(topo.group("tp"), cfg) for name, cfg in VARIANTS.items()}
    finally:
        topo.destroy()


def test_tp_activation_memory_follows_korthikanti(rank_pool):
    t = 2
    outs = rank_pool.run(memory_worker, t)
    assert outs[0] == outs[1]
    m = outs[0]
    attention = 3 * 4 * B * SHAPE["n_heads"] * S * S  # softmax, dropout mask, dropout output (fp32)
    # sequence parallelism: everything divided by t
    assert m["tp_sp"] * t == m["none"]
    # plain TP: the part outside the regions stays; what it saves is (t-1)/t of the in-region part
    assert m["none"] / t < m["tp"] < m["none"]
    # selective recomputation removes exactly this rank's share of the a·s² term
    assert m["tp_sp"] - m["tp_sp_selective"] == attention // t
