"""No tensor that a GPU job would hold on the host reaches a collective, in any strategy.

Every rank runs under ``EmulatedAccelerator(cpu:0)`` (tessera.testing.emulated_accelerator): ``cpu:0``
plays the accelerator, the groups are declared on it, the model and its batches are moved to it, while
a tensor made without a device, by ``.cpu()``, ``device="cpu"`` or from host memory reads ``cpu``. So a
stray host tensor handed to ``tessera.comm`` raises DeviceMismatchError here, as NCCL would reject it on
a GPU. The trainer drives one step (plus validation, metrics, memory gathering, the run folder, the
pipeline timeline and a checkpoint) of each layout; library-only strategies (local SGD, the dense
parameter-server variants) run one step of their own.
"""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import tessera
from tessera import comm
from tessera.comm import DeviceMismatchError
from tessera.testing.emulated_accelerator import EmulatedAccelerator, is_host
from tessera.topology import ParallelConfig, Topology

ACCEL = torch.device("cpu", 0)  # the emulated accelerator: not where device-less tensors land


def trainer_args(out_dir, cache, name, extra=(), steps=1):
    return ["--model.preset=tiny", f"--train.steps={steps}", "--train.log_every=1", "--train.eval_every=1",
            "--data.seq_len=32", "--data.global_batch_size=8", "--data.micro_batch_size=2",
            "--data.eval_batches=1", f"--data.cache_dir={cache}", f"--run.out_dir={out_dir}",
            f"--run.name={name}", "--run.progress=false", "--checkpoint.save_final=false", *extra]


def emulated_trainer(rank, world_size, args):
    """One rank of a training run with the groups, model and batches on the emulated accelerator."""
    from tessera.train.config import load_config
    from tessera.train.trainer import Trainer

    cfg = load_config(None, args)
    with EmulatedAccelerator(ACCEL):
        trainer = Trainer(cfg, ACCEL)
        try:
            summary = trainer.fit()
            groups = {str(trainer.topology.group(name).device) for name in trainer.topology.names}
        finally:
            trainer.close()
    return {"groups": groups, **{k: summary[k] for k in ("val_loss_end", "layout", "resumed_from_step")}}


PP = ["--parallel.pp=2", "--pipeline.microbatches=2"]
MOE = ["--model.num_experts=4", "--moe.top_k=2"]
LAYOUTS = {  # name: (ranks, settings)
    "ddp": (2, []),
    "ddp-recompute": (2, ["--checkpointing.mode=full"]),
    "ddp-find-unused": (2, ["--ddp.find_unused_parameters=true"]),
    "zero1": (2, ["--parallel.zero_stage=1"]),
    "zero2-offload": (2, ["--parallel.zero_stage=2", "--zero.offload=true"]),
    "zero3": (2, ["--parallel.zero_stage=3"]),
    "zero3-offload": (2, ["--parallel.zero_stage=3", "--zero.offload=true"]),
    "bf16-masters": (2, ["--precision.dtype=bf16"]),
    "pp-gpipe-recompute": (2, [*PP, "--pipeline.schedule=gpipe", "--pipeline.recompute=true"]),
    "pp-1f1b": (2, [*PP, "--pipeline.schedule=1f1b"]),
    "pp-interleaved": (2, ["--parallel.pp=2", "--pipeline.schedule=interleaved", "--pipeline.microbatches=4",
                           "--pipeline.virtual_stages=2", "--model.n_layers=4"]),
    "pp-zb-h1": (2, [*PP, "--pipeline.schedule=zb-h1"]),
    "pp-pipedream": (2, [*PP, "--pipeline.schedule=pipedream"]),
    "pp-2bw": (2, [*PP, "--pipeline.schedule=2bw"]),
    "dp2xpp2-zero1": (4, [*PP, "--parallel.zero_stage=1"]),
    "tp": (2, ["--parallel.tp=2"]),
    "tp-sp": (2, ["--parallel.tp=2", "--tensor_parallel.sequence_parallel=true"]),
    "cp-ring": (2, ["--parallel.cp=2", "--context_parallel.method=ring"]),
    "cp-ulysses": (2, ["--parallel.cp=2", "--context_parallel.method=ulysses"]),
    "cp-ring-self-attention": (2, ["--parallel.cp=2", "--context_parallel.method=ring_self_attention"]),
    "ep-moe": (2, [*MOE, "--parallel.ep=2"]),
    "ep-moe-zero1": (2, [*MOE, "--parallel.ep=2", "--parallel.zero_stage=1"]),
    "dp-moe": (2, MOE),
    # issue 15's compositions: the pipeline's engines in manual mode, routing under cp, expert ZeRO-3
    "pp-bf16": (2, [*PP, "--pipeline.schedule=1f1b", "--precision.dtype=bf16"]),
    "pp-zero3-tied": (2, [*PP, "--pipeline.schedule=1f1b", "--parallel.zero_stage=3", "--model.tie_embeddings=true"]),
    "pp-cp": (4, [*PP, "--pipeline.schedule=1f1b", "--parallel.cp=2"]),
    "pp-ep-moe": (4, [*PP, "--pipeline.schedule=1f1b", *MOE, "--parallel.ep=2"]),
    "cp-moe": (2, [*MOE, "--parallel.cp=2"]),
    "ep-moe-zero3": (2, [*MOE, "--parallel.ep=2", "--parallel.zero_stage=3"]),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_keeps_collective_tensors_on_the_device(rank_pool, tmp_path, corpus_cache, name):
    world, extra = LAYOUTS[name]
    results = rank_pool.run(emulated_trainer, world, args=trainer_args(tmp_path, corpus_cache, name, extra))
    assert len({r["val_loss_end"] for r in results}) == 1  # every rank finished the same run
    assert all(r["groups"] == {"cpu:0"} for r in results)  # every group was declared on the emulated device
    for axis, degree in (a[len("--parallel."):].split("=") for a in extra if a.startswith("--parallel.")):
        assert axis == "zero_stage" or f"{axis}={degree}" in results[0]["layout"]  # the layout asked for ran


@pytest.mark.multirank
@pytest.mark.parametrize("name,extra", [("ddp", []), ("zero3", ["--parallel.zero_stage=3"]),
                                        ("ep-moe-zero1", [*MOE, "--parallel.ep=2", "--parallel.zero_stage=1"])])
def test_checkpoint_save_and_resume_keep_tensors_on_the_device(rank_pool, tmp_path, corpus_cache, name, extra):
    """The save path (DCP pieces, the all-ranks-agree check) and the load path (resharding reads, the
    gathered random-generator states) of one step, then one more step after resuming."""
    first = trainer_args(tmp_path, corpus_cache, name, [*extra, "--checkpoint.save_final=true"])
    rank_pool.run(emulated_trainer, 2, args=first)
    resumed = rank_pool.run(emulated_trainer, 2, args=trainer_args(
        tmp_path, corpus_cache, name, [*extra, "--checkpoint.resume=auto"], steps=2))
    assert [r["resumed_from_step"] for r in resumed] == [1, 1]


def tp_nd_worker(rank, world_size, mode, depth):
    """One forward and backward of a 2D / 2.5D / 3D transformer block (Colossal-AI's layouts)."""
    from tessera.models import model_config
    from tessera.models.layers import TransformerBlock, precompute_rope
    from tessera.tensor_parallel.nd import Grid2D, Grid3D, Layout2D, Layout3D, TransformerBlockND

    cfg = model_config("tiny", dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64)
    with EmulatedAccelerator(ACCEL):
        topo = Topology.build(ParallelConfig(tp=world_size), device=ACCEL)
        try:
            tp, part = topo.group("tp"), topo.partitions["tp"]
            grid = Grid3D.build(tp, part) if mode == "3d" else Grid2D.build(tp, part, depth)
            layout = Layout3D(grid) if mode == "3d" else Layout2D(grid)
            torch.manual_seed(0)
            block = TransformerBlockND(TransformerBlock(cfg).to(ACCEL), layout)
            x = layout.shard(torch.randn(8, 8, cfg.dim, device=ACCEL)).requires_grad_()
            cos, sin = (t.to(ACCEL) for t in precompute_rope(cfg.head_dim, 8))
            block(x, cos, sin).square().sum().backward()
            return float(x.grad.square().sum())
        finally:
            topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("mode,world,depth", [("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)])
def test_tensor_parallel_nd_keeps_collective_tensors_on_the_device(rank_pool, mode, world, depth):
    assert all(g > 0 for g in rank_pool.run(tp_nd_worker, world, mode=mode, depth=depth))


def dense_sync_worker(rank, world_size, strategy):
    """One step of local SGD or of a dense parameter-server variant."""
    from tessera.parameter_server.dense import DenseParameterSync
    from tessera.parameter_server.local_sgd import LocalSGD

    with EmulatedAccelerator(ACCEL):
        topo = Topology.build(ParallelConfig(dp_replicate=world_size), device=ACCEL)
        try:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1)).to(ACCEL)  # 51 params: odd
            x, y = torch.randn(4, 8, device=ACCEL), torch.randn(4, 1, device=ACCEL)
            nn.functional.mse_loss(model(x), y).backward()
            if strategy == "local_sgd":
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                opt.step()
                LocalSGD(model, topo.group("dp"), every=1).after_step()
            else:
                DenseParameterSync(model, topo.group("dp"), strategy, lambda ps: torch.optim.SGD(ps, lr=0.1)).step()
            return [p.detach().clone() for p in model.parameters()]
        finally:
            topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", ["local_sgd", "allreduce", "ps_rank0", "ps_sharded"])
def test_local_sgd_and_dense_servers_keep_collective_tensors_on_the_device(rank_pool, strategy):
    a, b = rank_pool.run(dense_sync_worker, 2, strategy=strategy)
    for pa, pb in zip(a, b):  # the step synchronised the replicas
        torch.testing.assert_close(pa, pb)


# ---- the emulation itself: it tells host tensors apart, and the comm check fires on them -------------
def test_library_code_has_no_tensor_the_emulation_cannot_see():
    """The legacy typed constructors (``torch.Tensor(data)``, ``torch.LongTensor(...)``) bypass the
    torch-function protocol, so the emulation cannot tell where they land: library code never uses them."""
    src = Path(tessera.__file__).parent
    legacy = re.compile(r"torch\.(Float|Long|Int|Double|Byte|Bool|Half|BFloat16)?Tensor\(")
    assert legacy.search("x = torch.LongTensor([1])") and not legacy.search("torch.Tensor.backward(")
    found = [f"{path.relative_to(src)}:{i}" for path in sorted(src.rglob("*.py"))
             if path.name != "emulated_accelerator.py"  # it names them, in its docstring
             for i, line in enumerate(path.read_text().splitlines(), 1) if legacy.search(line)]
    assert found == []


def test_emulation_tells_host_tensors_from_device_tensors():
    with EmulatedAccelerator(ACCEL):
        dev = torch.ones(3, device=ACCEL)
        assert dev.device == ACCEL and not is_host(dev)
        host = [torch.zeros(3), dev.cpu(), torch.zeros(3, device="cpu"), dev.to(torch.device("cpu")),
                torch.frombuffer(bytearray(b"abc"), dtype=torch.uint8), torch.tensor([1.0]) + 1]
        assert all(t.device == torch.device("cpu") and is_host(t) for t in host)
        assert not is_host(dev)  # .cpu() made a copy; the device tensor stays a device tensor
        moved = [host[0].to(ACCEL), host[0].to(dev.device), torch.zeros(3, device=dev.device),
                 torch.tensor(2.0) * dev, torch.zeros_like(dev), host[0] + dev]
        assert all(t.device == ACCEL for t in moved)
        layer = nn.Linear(2, 2)
        assert layer.weight.device == torch.device("cpu")  # made without a device: on the host
        assert layer.to(ACCEL).weight.device == ACCEL and isinstance(layer.weight, nn.Parameter)
    assert torch.zeros(1).device == torch.device("cpu")  # nothing left behind


def grad_hook_worker(rank, world_size):
    """A stray made inside backward (where DDP, ZeRO and tp issue their collectives) is caught too."""
    with EmulatedAccelerator(ACCEL):
        group = comm.CommGroup.single("dp", device=ACCEL)
        w = nn.Parameter(torch.ones(2, device=ACCEL))
        w.register_post_accumulate_grad_hook(lambda p: comm.all_reduce(torch.zeros(2), group))
        with pytest.raises(DeviceMismatchError, match="all_reduce on axis 'dp'.* on cpu but the group's device is"):
            (w * 2).sum().backward()


def test_backward_under_the_emulation_keeps_torchs_checks():
    """backward() runs inside the emulation, yet refuses what torch refuses (code that the emulation
    let through would fail on a GPU) and accepts every form torch accepts."""
    with EmulatedAccelerator(ACCEL):
        w = nn.Parameter(torch.ones(2, 3, device=ACCEL))
        with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
            (w * 2).backward()
        with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
            torch.autograd.backward([(w * 2).sum(), w * 3])
        with pytest.raises(RuntimeError, match="Mismatch in shape"):
            (w * 2).backward(torch.ones(3, device=ACCEL))
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.ones(2, device=ACCEL).sum().backward()
        (w * 2).backward(torch.ones(2, 3, device=ACCEL), retain_graph=False)
        torch.autograd.backward((w * 3).sum(), inputs={"w": w})
        torch.autograd.backward([(w * 4).sum(), (w * 5).sum()], grad_tensors=[None, torch.tensor(2.0, device=ACCEL)])
        assert torch.equal(w.grad, torch.full((2, 3), 2.0 + 3.0 + 4.0 + 10.0, device=ACCEL))
        assert w.grad.device == ACCEL and not is_host(w.grad)


@pytest.mark.parametrize("stray", ["device-less", ".cpu()", 'device="cpu"', "frombuffer", "backward hook"])
def test_stray_host_tensors_fail_the_comm_check(stray):
    if stray == "backward hook":
        return grad_hook_worker(0, 1)
    with EmulatedAccelerator(ACCEL):
        group = comm.CommGroup.single("pp", device=ACCEL)
        good = torch.ones(4, device=ACCEL)
        comm.broadcast(good, group)  # a device tensor passes
        bad = {"device-less": lambda: torch.zeros(4), ".cpu()": lambda: good.cpu(),
               'device="cpu"': lambda: torch.zeros(4, device="cpu"),
               "frombuffer": lambda: torch.frombuffer(bytearray(4), dtype=torch.uint8)}[stray]()
        with pytest.raises(DeviceMismatchError, match="rank 0: broadcast on axis 'pp'"):
            comm.broadcast(bad, group)
