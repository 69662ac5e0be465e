"""Disk offload of ZeRO's fp32 master weights and AdamW state (``zero.offload = "disk"``,
tessera.zero.offload): the streamed update equals torch's AdamW bit for bit, a trainer run equals the
same run without offload, checkpoints cross between the two, the files hold the state and leave the
resident set after each step, and a bad folder is refused before any rank starts."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.comm.group import CommGroup
from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.models import Transformer, model_config
from tessera.models.layers import TransformerBlock
from tessera.precision.config import PrecisionConfig
from tessera.train.config import load_config, validate_config
from tessera.train.optim import OptimConfig, optimizer_factory, param_groups
from tessera.zero.build import build_engine
from tessera.zero.config import ZeroConfig
from tessera.zero.offload import OffloadFolder, StreamedAdamW, chunk_elements, disk_master
from tessera.zero.offload.check import check_disk_offload, offload_folder

from test_resume import crash_after, records, same_records
from test_trainer import tiny_args, trainer_worker

ROOT = Path(__file__).resolve().parent.parent
PAGE_CHUNK_MB = 4096 / 2**20  # one page per chunk: tiny shards still stream in several chunks


# ---- the streamed update --------------------------------------------------------------------------------


@pytest.mark.parametrize("amsgrad", [False, True])
def test_streamed_adamw_equals_torch_adamw_bit_for_bit(tmp_path, amsgrad):
    """Masters of odd sizes, several chunks each, two groups, a changing learning rate (a scheduler's
    writes): masters, moments, step counts and the bf16 mirrors equal torch.optim.AdamW's exactly."""
    g = torch.Generator().manual_seed(0)
    sizes = [5000, 1024, 3, 2049]
    start = [torch.randn(n, generator=g) for n in sizes]
    grads = [[torch.randn(n, generator=g) for n in sizes] for _ in range(3)]
    folder = OffloadFolder(tmp_path, 0, chunk_elements(PAGE_CHUNK_MB))
    mirrors = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    ours = [disk_master(x, m, folder) for x, m in zip(start, mirrors)]
    ref = [torch.nn.Parameter(x.clone()) for x in start]

    def make(params):
        return torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1},
                                  {"params": params[2:], "weight_decay": 0.0}],
                                 lr=1e-2, betas=(0.9, 0.95), eps=1e-8, amsgrad=amsgrad)

    opt, reference = StreamedAdamW(make(ours)), make(ref)
    for step, gs in enumerate(grads):
        for o in (opt, reference):
            for group in o.param_groups:
                group["lr"] = 1e-2 / (step + 1)
        for p, q, grad in zip(ours, ref, gs):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        reference.step()
    for p, q, m in zip(ours, ref, mirrors):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(m, q.detach().to(torch.bfloat16))
        for key, value in reference.state[q].items():
            assert torch.equal(opt.state[p][key], value), key
    moments = 3 if amsgrad else 2
    assert opt.bytes_read == opt.bytes_written == 3 * (1 + moments) * 4 * sum(sizes)


def test_a_folder_left_by_a_killed_run_is_removed_and_a_live_one_kept(tmp_path):
    stale = tmp_path / "rank0-oldrun"
    stale.mkdir()
    (stale / "lock").write_text("")
    (stale / "master-0.bin").write_bytes(b"\0" * 4096)
    live = OffloadFolder(tmp_path, 1, chunk_elements(1.0))
    live.tensor(10, "master")
    OffloadFolder(tmp_path, 0, chunk_elements(1.0))
    assert not stale.exists()
    assert live.path.is_dir() and len(live.files()) == 1  # its lock is held: never swept


# ---- the files hold the state, and leave the resident set ----------------------------------------------


def _mapped_rss(folder: Path) -> int:
    """Resident bytes of this process's mappings of files in ``folder`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and len(head[0]) > 8 and ":" in head[3]:
            inside = len(head) >= 6 and head[5].startswith(str(folder))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def _engine(zero: ZeroConfig, stage: int):
    cfg = model_config("tiny")
    torch.manual_seed(0)
    model = Transformer(cfg)
    optim = OptimConfig()
    one = CommGroup.single("dp_shard")
    engine = build_engine(model, param_groups(model, optim), optimizer_factory(optim), one,
                          CommGroup.single("dp_replicate"), stage, zero, PrecisionConfig(dtype="bf16"),
                          torch.device("cpu"), TransformerBlock)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        logits = engine(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        engine.clip_grad_norm(1.0)
        engine.step()
        engine.zero_grad()
    return engine


@pytest.mark.parametrize("stage", [1, 3])
def test_the_files_hold_masters_and_state_and_leave_the_resident_set(tmp_path, stage):
    base = tmp_path / "offload"
    engine = _engine(ZeroConfig(offload="disk", offload_dir=str(base), offload_chunk_mb=PAGE_CHUNK_MB), stage)
    (folder,) = [p for p in base.iterdir() if p.name.startswith("rank0-")]
    assert _mapped_rss(folder) == 0  # every chunk was written back and unmapped after the steps
    files = {p.name: p for p in folder.glob("*.bin")}
    masters = [s.master for s in engine.update.shards]
    elements = sum(m.numel() for m in masters)
    assert sum(p.stat().st_size for p in files.values()) == 12 * elements  # fp32 master + two moments
    assert len(files) == 3 * len(masters)
    on_file = {name: torch.from_numpy(np.fromfile(path, dtype=np.float32)) for name, path in files.items()}
    found = [t for m in masters for t in (m.detach(), engine.optimizer.state[m]["exp_avg"],
                                         engine.optimizer.state[m]["exp_avg_sq"])]
    assert all(any(torch.equal(t, f) for f in on_file.values()) for t in found)
    assert all(engine.optimizer.state[m]["exp_avg_sq"].abs().sum() > 0 for m in masters)  # it stepped
    # the same steps with the state in RAM give the same masters and compute-dtype shards
    plain = _engine(ZeroConfig(), stage)
    for a, b in zip(engine.update.shards, plain.update.shards):
        assert torch.equal(a.master.detach(), b.master.detach()) and torch.equal(a.param, b.param)


# ---- a trainer run equals the same run without offload --------------------------------------------------

LAYOUTS = {  # name: (world, overrides)
    "zero3-bf16": (2, ["--parallel.zero_stage=3", "--precision.dtype=bf16"]),
    "zero3-fp32": (2, ["--parallel.zero_stage=3"]),
    "zero1-bf16": (2, ["--parallel.zero_stage=1", "--precision.dtype=bf16"]),
    "zero1-fp32": (2, ["--parallel.zero_stage=1"]),
    "pp2-zero1-bf16": (2, ["--parallel.pp=2", "--parallel.zero_stage=1", "--precision.dtype=bf16",
                           "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"]),
    "ep2-zero1-bf16": (2, ["--parallel.zero_stage=1", "--precision.dtype=bf16", "--model.num_experts=4",
                           "--parallel.ep=2", "--moe.top_k=2"]),
}


def disk(tmp_path):
    return ["--zero.offload=disk", f"--zero.offload_dir={tmp_path / 'offload'}",
            f"--zero.offload_chunk_mb={PAGE_CHUNK_MB}"]


def train_records(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records(run_dir) if r["kind"] == "train"]


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_disk_offload_matches_the_run_in_memory(rank_pool, tmp_path, corpus_cache, name):
    world, extra = LAYOUTS[name]
    runs = {}
    for kind, more in (("ram", []), ("disk", disk(tmp_path))):
        args = tiny_args(tmp_path, corpus_cache, steps=4, extra=[*extra, *more, f"--run.name={kind}",
                                                                  "--train.log_every=1"])
        runs[kind] = rank_pool.run(trainer_worker, world, args=args)[0]
    assert [r[0] for r in train_records(tmp_path / "ram")] == [1, 2, 3, 4]
    assert train_records(tmp_path / "disk") == train_records(tmp_path / "ram")
    assert runs["disk"]["val_loss_end"] == runs["ram"]["val_loss_end"]
    # the masters and moments were not in RAM (the ledger counts what RAM holds): only the step counters
    for held, ram in zip(runs["disk"]["memory_per_rank"], runs["ram"]["memory_per_rank"]):
        assert held["optimizer"] < 1e-3 * ram["optimizer"], (held, ram)


# ---- checkpoints -----------------------------------------------------------------------------------------

STEPS, EVERY = 6, 3
ZERO3 = ["--parallel.zero_stage=3", "--precision.dtype=bf16"]


def ckpt_args(tmp_path, cache, name, extra=()):
    return tiny_args(tmp_path, cache, steps=STEPS, extra=[*ZERO3, f"--run.name={name}", "--train.log_every=1",
                                                          f"--checkpoint.every={EVERY}", *extra])


@pytest.mark.multirank
def test_resume_with_and_without_disk_offload_repeats_the_run(rank_pool, tmp_path, corpus_cache):
    """Killed after step 3 and resumed: with offload, without offload (the checkpoint offload wrote), and
    with offload from a checkpoint written without it; each repeats the uninterrupted run exactly."""
    rank_pool.run(trainer_worker, 2, args=ckpt_args(tmp_path, corpus_cache, "full", disk(tmp_path)))
    rank_pool.run(trainer_worker, 2, args=ckpt_args(tmp_path, corpus_cache, "plain"))
    assert [r[0] for r in train_records(tmp_path / "plain")] == list(range(1, STEPS + 1))
    assert train_records(tmp_path / "full") == train_records(tmp_path / "plain")
    resumes = {"disk-to-disk": ("full", disk(tmp_path)), "disk-to-ram": ("full", []),
               "ram-to-disk": ("plain", disk(tmp_path))}
    for name, (source, extra) in resumes.items():
        crash_after(tmp_path / source, tmp_path / name, EVERY)
        resumed = rank_pool.run(trainer_worker, 2, args=ckpt_args(tmp_path, corpus_cache, name,
                                                                  [*extra, "--checkpoint.resume=auto"]))[0]
        assert resumed["resumed_from_step"] == EVERY, name
        same_records(records(tmp_path / source), records(tmp_path / name))


# ---- refused before launch ------------------------------------------------------------------------------


def test_a_folder_that_cannot_be_made_exits_2_before_any_rank_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--nproc", "2", "--model.preset=tiny",
                           "--parallel.zero_stage=3", "--zero.offload=disk",
                           f"--zero.offload_dir={blocker / 'offload'}", f"--run.out_dir={tmp_path / 'runs'}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.startswith("tessera: error: zero.offload_dir:") and "is not a folder" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing started


def test_too_little_free_space_is_refused(tmp_path, monkeypatch):
    cfg = load_config(None, ["--model.preset=tiny", "--parallel.zero_stage=1", "--zero.offload=disk",
                             f"--run.out_dir={tmp_path}", "--run.nproc=2"])
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(ConfigError, match=r"needs .* GB but the disk of .* has 0.00 GB free"):
        check_disk_offload(cfg, cfg.parallel.resolved(2), 2)
    assert cfg.zero.offload_dir == "" and offload_folder(cfg) == tmp_path / "offload"  # the default, inside run.out_dir; the config is not rewritten


def test_offload_keys_parse_and_validate(tmp_path):
    base = ["--model.preset=tiny", "--parallel.zero_stage=1", f"--run.out_dir={tmp_path}"]
    assert load_config(None, [*base, "--zero.offload=true"]).zero.offload == "host"
    assert load_config(None, [*base, "--zero.offload=false"]).zero.offload == "none"
    cfg = validate_config(load_config(None, [*base, "--zero.offload=disk"]), 2)
    assert cfg.zero.offload == "disk" and offload_folder(cfg) == tmp_path / "offload"
    with pytest.raises(ConfigError, match="zero.offload must be one of none, host, disk"):
        validate_config(load_config(None, [*base, "--zero.offload=nvme"]), 2)
    with pytest.raises(ConfigError, match="zero.offload_dir=.* has no effect"):
        validate_config(load_config(None, [*base, "--zero.offload_dir=/somewhere"]), 2)
    toml = tmp_path / "job.toml"
    toml.write_text("[zero]\noffload = true\n")  # the key's old boolean form, from a file
    assert load_config(str(toml)).zero.offload == "host"
