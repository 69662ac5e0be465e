"""Catalogues of accelerators and model shapes the planner can size, overridable by name=value or a file.

Numbers are public data-sheet figures (dense bf16 tensor-core peak, no sparsity; memory as sold; NVLink
bandwidth per GPU in one direction; network bandwidth per GPU as the NICs of the reference DGX/HGX node
give it). Model shapes are the published ones: GPT-3 (Brown et al. 2020, Table 2.1), Llama 2 (Touvron
et al. 2023) and Llama 3 (Dubey et al. 2024), plus tessera's own reference presets.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from tessera.errors import ConfigError
from tessera.lora.config import TARGETS as LORA_TARGETS
from tessera.lora.config import LoRAConfig
from tessera.models.config import PRESETS, ModelConfig

GiB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator and the links around it."""

    name: str
    peak_flops: float  # dense bf16 (or the calibrated dtype) FLOP/s
    memory_bytes: float  # device memory
    hbm_bytes_per_s: float  # memory bandwidth (the optimizer step is bound by it)
    intra_bytes_per_s: float  # NVLink bandwidth per GPU, one direction
    inter_bytes_per_s: float  # network bandwidth per GPU, one direction
    gpus_per_node: int = 8  # GPUs that share the intra-node link
    intra_alpha_s: float = 5e-6  # latency per ring step inside a node
    inter_alpha_s: float = 15e-6  # latency per ring step across nodes
    compute_efficiency: float = 0.75  # fraction of peak a large matmul reaches
    host_bytes_per_s: float = 25e9  # host<->device (PCIe) bandwidth, for offload
    host_adam_params_per_s: float = 2e9  # CPU Adam rate when the optimizer is offloaded
    usable_fraction: float = 0.92  # of memory_bytes, the rest is context, allocator slack, fragmentation
    overlap: float = 1.0  # share of compute that data-parallel collectives can hide behind (0 on shared CPU cores)
    # non-matmul kernels' seconds per byte of activations saved; 0: compute_efficiency covers them (GPUs)
    elementwise_s_per_byte: float = 0.0
    # exposed start-up of each blocking collective issued between compute segments, beyond α (the ranks'
    # arrival skew, waking the waiting rank); 0 where collectives queue asynchronously on a stream
    collective_sync_s: float = 0.0
    # fixed cost of one layer's forward and backward on one micro-batch, whatever its size (kernel
    # dispatch, autograd bookkeeping); 0 where launches overlap execution (GPUs)
    layer_call_s: float = 0.0
    # FLOP/s of attention's score and value matmuls (causal SDPA, forward and backward); 0: at peak_flops.
    # On CPU they run at about 60% of the layer matmuls' rate, and their share of a step grows with the
    # sequence, so a model calibrated on one sequence length must charge them apart
    attention_flops: float = 0.0
    # seconds per token, query head and layer (forward and backward) that attention costs beyond its FLOPs
    # at attention_flops: the per-row work of its kernel (softmax statistics, masking, blocking), the
    # same whatever the sequence, so short sequences run attention at a lower FLOP rate (on one CPU
    # thread, 64 tokens at ~24 GFLOP/s and 512 at ~43); 0: FLOPs only
    attention_row_s: float = 0.0
    # ring attention (cp > 1): seconds per query-key score of its blockwise kernels, forward and backward,
    # beyond their matmul FLOPs (4e and 10e per score) at attention_flops. Where calibrated, a cp layout's
    # attention is charged by the scores each rank computes instead of as one fused SDPA: the blocks
    # materialize their float32 scores and run softmax, masking and the online merge over them (on one CPU
    # thread about twice the fused kernel's time); 0: as SDPA
    ring_forward_s: float = 0.0
    ring_backward_s: float = 0.0
    # FLOP/s of bf16 matmuls where they differ from peak_flops (a calibrated CPU, whose peak_flops is its
    # fp32 rate: without bf16 instructions bf16 runs tens of times slower); 0: mixed precision at peak_flops
    half_flops: float = 0.0
    # GPU kernel model (tessera.planner.gpu_kernels; 0 = off: everything at peak × compute_efficiency, as a
    # calibrated CPU is timed): the share of HBM bandwidth non-matmul kernels reach
    hbm_efficiency: float = 0.0
    kernel_gap_s: float = 0.0  # idle device time between two consecutive kernels of a layer
    sm_count: int = 0  # streaming multiprocessors: a GEMM's output tiles run in waves of this many (0: ignore)
    nccl_efficiency: float = 1.0  # bus bandwidth NCCL's collectives reach, as a share of the link's


# The GPU kernel model's constants, one set per GPU family (docs/PLANNER.md, "Published runs", says which
# published runs were looked at when each was chosen): compute_efficiency 0.75 (A100, the planner's earlier
# default) / 0.65 (H100, chosen between the torchtitan 8-GPU and Llama 3 405B runs): a full-wave GEMM's
# share of peak; attention_flops: FlashAttention-2 forward + backward on causal inputs, 60% of peak on A100
# (Dao 2023) and 27.5% on H100 (Shah et al. 2024, FA2 on H100); sm_count from the data sheets (108, 132);
# assumed without a measurement of their own: hbm_efficiency 0.80 (a streaming kernel's share of HBM
# bandwidth), kernel_gap_s 1 µs, nccl_efficiency 0.80 (bus bandwidth as a share of the line rate).
_A100 = dict(compute_efficiency=0.75, attention_flops=0.60 * 312e12, hbm_efficiency=0.80, kernel_gap_s=1e-6,
             sm_count=108, nccl_efficiency=0.80)
_H100 = dict(compute_efficiency=0.65, attention_flops=0.275 * 989e12, hbm_efficiency=0.80, kernel_gap_s=1e-6,
             sm_count=132, nccl_efficiency=0.80)
GPUS: dict[str, GpuSpec] = {
    # A100 SXM: 312 TFLOP/s bf16; NVLink3 600 GB/s bidirectional; DGX A100 has 8x HDR 200 Gb/s NICs.
    "a100-40gb": GpuSpec("a100-40gb", 312e12, 40 * GiB, 1.555e12, 300e9, 25e9, **_A100),
    "a100-80gb": GpuSpec("a100-80gb", 312e12, 80 * GiB, 2.039e12, 300e9, 25e9, **_A100),
    # H100 SXM: 989 TFLOP/s bf16 dense; NVLink4 900 GB/s bidirectional; DGX H100 has 8x NDR 400 Gb/s.
    "h100": GpuSpec("h100", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9, **_H100),
    # H100 SXM with 96 GB of HBM2e at 2.4 TB/s, run at a 500 W limit (Meta's Grand Teton, where torchtitan
    # measured): its peak lies "between SXM and NVL" (torchtitan, which does not know it); 835 TFLOP/s, the
    # NVL's and the low end of that range, is ASSUMED — the torchtitan runs set it (docs/PLANNER.md).
    "h100-hbm2e": GpuSpec("h100-hbm2e", 835e12, 96 * GiB, 2.4e12, 450e9, 50e9,
                          **{**_H100, "attention_flops": 0.275 * 835e12}),
    # H200 SXM: the H100's compute with 141 GB of HBM3e at 4.8 TB/s.
    "h200": GpuSpec("h200", 989e12, 141e9, 4.8e12, 450e9, 50e9, **_H100),
}
GPU_ALIASES = {"a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb", "h100-80gb": "h100"}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's shapes. ``arch`` 'gpt' (LayerNorm, GeLU MLP of 4h, learned positions, biases, tied
    head) or 'llama' (RMSNorm, SwiGLU, GQA, RoPE, no biases). ``lora_rank`` > 0: a LoRA job (the
    ``[lora]`` section): adapters of rank r on the ``lora_targets`` linears of every layer (each expert's
    too), every other parameter frozen; the counts below (``num_params`` …) are the base model's."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int  # the training sequence length it was published with
    arch: str = "llama"
    tied: bool = False
    experts: int = 1  # MoE: copies of the FFN per layer (1 = dense)
    top_k: int = 1  # MoE: experts each token visits
    moe_every: int = 1  # MoE: every moe_every-th layer has experts
    qkv_bias: bool = False  # llama arch: biases on q, k, v (Qwen2)
    lora_rank: int = 0  # LoRA adapter rank r; 0 = full training
    lora_targets: tuple = tuple(LoRAConfig().targets)  # the adapted linears (names of tessera.lora.TARGETS)

    def __post_init__(self):
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.lora_rank < 0:
            raise ConfigError(f"model {self.name}: lora_rank must be a non-negative integer, got {self.lora_rank}")
        unknown = sorted(set(self.lora_targets) - set(self.linear_shapes()))
        if self.lora_rank and (unknown or not self.lora_targets):
            raise ConfigError(f"model {self.name}: lora_targets must name some of its linears "
                              f"({', '.join(self.linear_shapes())}), got {', '.join(self.lora_targets) or 'none'}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def attention_params(self) -> int:
        h, e = self.hidden, self.head_dim
        weights = 2 * h * self.heads * e + 2 * h * self.kv_heads * e
        if self.arch == "gpt":
            return weights + 4 * h  # GPT's q, k, v, o biases
        return weights + ((self.heads + 2 * self.kv_heads) * e if self.qkv_bias else 0)

    def ffn_params(self) -> int:
        """One expert's FFN (GeLU MLP with biases for gpt, SwiGLU for llama)."""
        h, f = self.hidden, self.ffn
        return 2 * h * f + f + h if self.arch == "gpt" else 3 * h * f

    def linear_shapes(self) -> dict[str, tuple[int, int, str]]:
        """(in, out, tensor-parallel split) of each linear of a layer an adapter may sit on (the FFN's: one
        expert's), as tessera's tensor-parallel plan splits them: 'column' (output features) or 'row'."""
        h, e, f = self.hidden, self.head_dim, self.ffn
        shapes = {"wq": (h, self.heads * e, "column"), "wk": (h, self.kv_heads * e, "column"),
                  "wv": (h, self.kv_heads * e, "column"), "wo": (self.heads * e, h, "row"),
                  "w1": (h, f, "column"), "w2": (f, h, "row"), "w3": (h, f, "column")}
        if self.arch == "gpt":  # GeLU MLP: w1 (h → 4h) and w2 only
            del shapes["w3"]
        return {k: v for k, v in shapes.items() if k in LORA_TARGETS}

    def adapter_layer_params(self, tp: int = 1) -> tuple[float, float]:
        """(dense, expert) LoRA parameters of an average layer that one of ``tp`` ranks holds (0, 0 without
        LoRA). An adapter on an [out, in] weight is A [r, in] and B [out, r]; tensor parallelism splits it
        as the weight (``tessera.tensor_parallel.adapters``): column-parallel keeps A whole and B's rows
        [out/t, r], row-parallel A's columns [r, in/t] and B whole. Expert adapters are sharded over ep."""
        if not self.lora_rank:
            return 0.0, 0.0
        r, attn, ffn = self.lora_rank, 0.0, 0.0
        for name in self.lora_targets:
            n_in, n_out, split = self.linear_shapes()[name]
            held = r * (n_in + n_out / tp) if split == "column" else r * (n_in / tp + n_out)
            if name in ("wq", "wk", "wv", "wo"):
                attn += held
            else:
                ffn += held
        frac = self.moe_fraction
        return attn + (1.0 - frac) * ffn, frac * ffn * self.experts

    def replicated_adapter_factors(self) -> list[tuple[float, float]]:
        """(share of layers, elements) of each adapter factor tensor parallelism keeps whole on every rank
        (column-parallel: A [r, in]; row-parallel: B [out, r]), whose gradient tp all-reduces in every
        backward; an FFN target's share is that of the dense layers (experts are not split over tp)."""
        out = []
        for name in self.lora_targets if self.lora_rank else ():
            n_in, n_out, split = self.linear_shapes()[name]
            share = 1.0 if name in ("wq", "wk", "wv", "wo") else 1.0 - self.moe_fraction
            if share:
                out.append((share, self.lora_rank * (n_in if split == "column" else n_out)))
        return out

    def adapter_params(self) -> int:
        """Trainable parameters of a LoRA job (every adapter, whole); 0 without LoRA."""
        return round(self.layers * sum(self.adapter_layer_params()))

    def norm_params(self) -> int:
        return (4 if self.arch == "gpt" else 2) * self.hidden

    @property
    def moe_fraction(self) -> float:
        """Share of layers whose FFN is a mixture of experts (every ``moe_every``-th layer)."""
        return 1.0 / self.moe_every if self.experts > 1 else 0.0

    def dense_layer_params(self) -> float:
        """Parameters of an average layer that every data-parallel rank holds (all but the experts)."""
        frac = self.moe_fraction
        return (self.attention_params() + self.norm_params() + frac * self.hidden * self.experts
                + (1.0 - frac) * self.ffn_params())

    def expert_layer_params(self) -> float:
        """Expert parameters of an average layer (sharded over ep)."""
        return self.moe_fraction * self.ffn_params() * self.experts

    def embedding_params(self) -> int:
        pos = self.seq * self.hidden if self.arch == "gpt" else 0
        return self.vocab * self.hidden + pos

    def final_norm_params(self) -> int:
        return (2 if self.arch == "gpt" else 1) * self.hidden

    def head_params(self) -> int:
        """Output projection plus final norm (the head weight counts 0 when tied to the embedding)."""
        return self.final_norm_params() + (0 if self.tied else self.vocab * self.hidden)

    def num_params(self) -> int:
        per_layer = self.dense_layer_params() + self.expert_layer_params()
        return round(self.layers * per_layer) + self.embedding_params() + self.head_params()

    def matmul_params_per_token(self) -> float:
        """Weights each token multiplies by (6 FLOPs each in training): active experts only, the output
        projection always (tied or not), the embedding lookup never."""
        frac = self.moe_fraction
        ffn = self.ffn_params() * (frac * self.top_k + 1.0 - frac) + frac * self.hidden * self.experts
        return self.layers * (self.attention_params() + ffn) + self.vocab * self.hidden


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    # Brown et al. 2020 Table 2.1; vocab 50257 padded to 51200 as Megatron does; ffn = 4h; seq 2048.
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, 51200, 2048, arch="gpt", tied=True)


def from_model_config(name: str, cfg: ModelConfig, top_k: int = 2, lora: LoRAConfig | None = None) -> ModelSpec:
    """The planner's view of a tessera reference-model config (Llama-style; MoE layers, when the config
    has them, with ``top_k`` experts per token and no residual or shared experts), with the adapters of
    ``lora`` (a job's ``[lora]`` section) when it has a rank."""
    experts = getattr(cfg, "num_experts", 0)
    adapters = {} if lora is None else {"lora_rank": lora.rank, "lora_targets": tuple(lora.targets)}
    return ModelSpec(name, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden_dim,
                     cfg.vocab_size, cfg.max_seq_len, arch="llama", tied=cfg.tie_embeddings,
                     experts=max(1, experts), top_k=top_k if experts > 1 else 1,
                     moe_every=getattr(cfg, "moe_every", 1) if experts > 1 else 1,
                     qkv_bias=getattr(cfg, "qkv_bias", False), **adapters)


MODELS: dict[str, ModelSpec] = {
    "gpt3-125m": _gpt3("gpt3-125m", 12, 768, 12),
    "gpt3-350m": _gpt3("gpt3-350m", 24, 1024, 16),
    "gpt3-760m": _gpt3("gpt3-760m", 24, 1536, 16),
    "gpt3-1.3b": _gpt3("gpt3-1.3b", 24, 2048, 16),
    "gpt3-2.7b": _gpt3("gpt3-2.7b", 32, 2560, 32),
    "gpt3-6.7b": _gpt3("gpt3-6.7b", 32, 4096, 32),
    "gpt3-13b": _gpt3("gpt3-13b", 40, 5120, 40),
    "gpt3-175b": _gpt3("gpt3-175b", 96, 12288, 96),
    "llama2-7b": ModelSpec("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": ModelSpec("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": ModelSpec("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    **{f"tessera-{k}": from_model_config(f"tessera-{k}", cfg) for k, cfg in PRESETS.items()},
}


def _replace(spec, overrides: dict, what: str):
    names = {f.name: f.type for f in dataclasses.fields(spec)}
    clean = {}
    for key, value in overrides.items():
        if key not in names:
            raise ConfigError(f"unknown {what} field '{key}'; valid fields are {', '.join(sorted(names))}")
        kind = type(getattr(spec, key))
        try:
            if kind is tuple:  # "wq,wv" (a command line) or ["wq", "wv"] (a spec file)
                clean[key] = tuple(v.strip() for v in value.split(",") if v.strip()) if isinstance(value, str) \
                    else tuple(value)
                continue
            clean[key] = (str(value).lower() in ("1", "true", "yes")) if kind is bool else kind(value)
        except ValueError:
            raise ConfigError(f"{what} field '{key}' needs a {kind.__name__}, got {value!r}") from None
    return dataclasses.replace(spec, **clean)


def _lookup(table: dict, aliases: dict, name: str, what: str):
    key = aliases.get(name.lower(), name.lower())
    if key not in table:
        raise ConfigError(f"unknown {what} '{name}'; choose one of {', '.join(sorted(table))}")
    return table[key]


def get_gpu(name: str, **overrides) -> GpuSpec:
    """A catalogue GPU with fields replaced (``peak_flops=...``); ConfigError for unknown names."""
    return _replace(_lookup(GPUS, GPU_ALIASES, name, "GPU"), overrides, "GPU")


def get_model(name: str, **overrides) -> ModelSpec:
    """A catalogue model with fields replaced (``seq=...``); ConfigError for unknown names."""
    return _replace(_lookup(MODELS, {}, name, "model"), overrides, "model")


def load_spec_file(path: str) -> tuple[dict, dict]:
    """A JSON file ``{"gpu": {field: value}, "model": {field: value}}`` of overrides (or full new specs
    when the GPU or model named is not in the catalogue: give every field then)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read the planner spec file {path}: {err}") from None
    return dict(data.get("gpu", {})), dict(data.get("model", {}))


def parse_overrides(items: list[str] | None) -> dict:
    """``["peak_flops=3e14", ...]`` → dict; ConfigError for an item without '='."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' must look like field=value")
        out[key.strip()] = value.strip()
    return out
