"""Tier 4: the same code on an accelerator (NCCL/CUDA). Skipped where no GPU is present."""

import pytest
import torch

from tessera.launch import run_rank
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
