"""Tier 4: the same code on an accelerator (NCCL/CUDA). Skipped where no GPU is present."""

import pytest
import torch

from tessera.launch import launch_local, run_rank
from tessera.train.config import load_config

pytestmark = pytest.mark.gpu


def test_tiny_run_on_one_gpu_matches_cpu(tmp_path, corpus_cache):
    args = ["--model.preset=tiny", "--train.steps=4", "--data.seq_len=32", "--data.global_batch_size=8",
            "--data.micro_batch_size=4", "--data.eval_batches=1", f"--data.cache_dir={corpus_cache}",
            f"--run.out_dir={tmp_path}", "--run.progress=false"]
    gpu = run_rank(load_config(None, args + ["--run.device=cuda", "--run.name=gpu"]))
    cpu = run_rank(load_config(None, args + ["--run.device=cpu", "--run.name=cpu"]))
    assert gpu["val_loss_start"] == pytest.approx(cpu["val_loss_start"], rel=1e-4)
    assert gpu["val_loss_end"] == pytest.approx(cpu["val_loss_end"], rel=1e-3)


def test_device_helpers_report_accelerator_memory():
    from tessera.device import peak_memory_bytes, resolve_device, synchronize

    device = resolve_device("cuda")
    x = torch.ones(1024, 1024, device=device)
    synchronize(device)
    assert peak_memory_bytes(device) >= x.numel() * 4


def test_nccl_groups_are_declared_on_the_ranks_accelerator():
    from tessera.device import comm_device

    assert comm_device("nccl") == torch.device("cuda", torch.cuda.current_device())


# Two ranks over NCCL against two ranks over gloo, through the CLI's own launcher (torch's elastic agent):
# the layouts whose collectives were once handed host tensors (the pipeline's loss broadcast and timeline,
# the MoE routing counters), and DDP.
LAYOUTS = {
    "ddp": ["--parallel.dp_replicate=2"],
    "pp-1f1b": ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"],
    "moe-ep": ["--model.num_experts=4", "--moe.top_k=2", "--parallel.ep=2"],
}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_gpu_ranks_over_nccl_match_two_cpu_ranks_over_gloo(tmp_path, corpus_cache, name):
    args = ["--model.preset=tiny", "--train.steps=4", "--train.log_every=2", "--data.seq_len=32",
            "--data.global_batch_size=8", "--data.micro_batch_size=2", "--data.eval_batches=1",
            f"--data.cache_dir={corpus_cache}", f"--run.out_dir={tmp_path}", "--run.progress=false",
            "--checkpoint.save_final=false", *LAYOUTS[name]]
    gpu = launch_local(load_config(None, args + ["--run.device=cuda", f"--run.name={name}-gpu"]), 2)
    cpu = launch_local(load_config(None, args + ["--run.device=cpu", f"--run.name={name}-cpu"]), 2)
    assert gpu["layout"] == cpu["layout"] and gpu["layout"].startswith("2 rank(s)")
    assert gpu["val_loss_start"] == pytest.approx(cpu["val_loss_start"], rel=1e-4)
    assert gpu["val_loss_end"] == pytest.approx(cpu["val_loss_end"], rel=1e-3)
