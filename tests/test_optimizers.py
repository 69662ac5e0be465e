"""optim.name (adamw, adam, sgd, adagrad) on every optimizer path: the factory's classes and settings, the
trainer at dp2 and under ZeRO equal to one process, resumes with SGD momentum and Adagrad state, and the
refusals (keys without effect, disk offload)."""

import pytest
import torch

from tessera.checkpoint.state import ensure_optimizer_state
from tessera.errors import ConfigError
from tessera.launch import run_rank
from tessera.train.config import load_config, validate_config
from tessera.train.optim import OptimConfig, build_optimizer, optimizer_factory
from tessera.zero.offload import OffloadFolder, StreamedAdamW, chunk_elements, disk_master

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import assert_like_single_process, metrics

CLASSES = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
           "adagrad": torch.optim.Adagrad}


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("kernel,flag", [("auto", None), ("foreach", "foreach"), ("fused", "fused")])
def test_factory_builds_the_named_optimizer(name, kernel, flag):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    cfg = OptimConfig(name=name, lr=0.01, weight_decay=0.3, momentum=0.8 if name == "sgd" else 0.0,
                      nesterov=name == "sgd", eps=1e-7)
    opt = build_optimizer(model, cfg, kernel)
    assert type(opt) is CLASSES[name]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]  # matrices only
    assert all(g["lr"] == 0.01 for g in opt.param_groups)
    if flag:  # [kernels] adamw reaches every optimizer class
        assert all(g[flag] for g in opt.param_groups)
    if name == "sgd":
        assert opt.defaults["momentum"] == 0.8 and opt.defaults["nesterov"]
    else:
        assert opt.defaults["eps"] == 1e-7
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # every flag has a kernel for this optimizer on this device


def test_adam_adds_weight_decay_to_the_gradient():
    """adam: L2 (DeepSpeed's adam_w_mode=false), so its first step on a zero gradient moves the weights by
    lr · sign(wd · w) — AdamW's decoupled decay would move them by lr · wd · w only."""
    w = torch.nn.Parameter(torch.full((2, 2), 0.5))
    opt = optimizer_factory(OptimConfig(name="adam", lr=0.1, weight_decay=0.1))([{"params": [w],
                                                                                   "weight_decay": 0.1}])
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.allclose(w.detach(), torch.full((2, 2), 0.4), atol=1e-6)


def test_zero_momentum_buffer_then_a_step_equals_a_fresh_sgd():
    """What a resume loads into: the SGD state ensure_optimizer_state creates steps like torch's first step."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    make = optimizer_factory(OptimConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True))
    opt_a, opt_b = make([{"params": list(a.parameters())}]), make([{"params": list(b.parameters())}])
    ensure_optimizer_state(opt_b)
    assert all(not opt_b.state[p]["momentum_buffer"].any() for p in b.parameters())
    x = torch.randn(5, 4)
    for _ in range(2):
        for model, opt in ((a, opt_a), (b, opt_b)):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q) and torch.equal(opt_a.state[p]["momentum_buffer"], opt_b.state[q]["momentum_buffer"])


@pytest.mark.parametrize("name,kernel", [("sgd", "auto"), ("sgd", "fused"), ("adagrad", "auto"),
                                         ("adagrad", "foreach"), ("adam", "auto")])
def test_disk_offload_streams_each_optimizer_bit_for_bit(tmp_path, name, kernel):
    """Masters of odd sizes in page-sized chunks, two groups, a changing lr: the streamed step equals the
    torch optimizer's exactly (masters, state, the bf16 mirrors)."""
    g = torch.Generator().manual_seed(0)
    sizes = [3000, 1024, 3]
    start = [torch.randn(n, generator=g) for n in sizes]
    folder = OffloadFolder(tmp_path, 0, chunk_elements(4096 / 2**20))  # one page per chunk
    mirrors = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    ours = [disk_master(x, m, folder) for x, m in zip(start, mirrors)]
    ref = [torch.nn.Parameter(x.clone()) for x in start]
    make = optimizer_factory(OptimConfig(name=name, lr=0.05, momentum=0.9 if name == "sgd" else 0.0,
                                         nesterov=name == "sgd"), kernel)
    opt = StreamedAdamW(make([{"params": ours[:2], "weight_decay": 0.1}, {"params": ours[2:], "weight_decay": 0.0}]))
    reference = make([{"params": ref[:2], "weight_decay": 0.1}, {"params": ref[2:], "weight_decay": 0.0}])
    for step in range(3):
        for o in (opt, reference):
            for group in o.param_groups:
                group["lr"] = 0.05 / (step + 1)
        for p, q in zip(ours, ref):
            grad = torch.randn(q.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        reference.step()
    for p, q, m in zip(ours, ref, mirrors):
        assert torch.equal(p.detach(), q.detach()) and torch.equal(m, q.detach().to(torch.bfloat16))
        assert set(opt.state[p]) == set(reference.state[q])
        for key, value in reference.state[q].items():
            assert torch.equal(opt.state[p][key], value), key
    assert opt.bytes_read > 0 and opt.bytes_written == opt.bytes_read


@pytest.mark.parametrize("extra,match", [
    (["--optim.momentum=0.9"], "optim.momentum=0.9 has no effect in this job: it applies only to optim.name='sgd'"),
    (["--optim.name=sgd", "--optim.beta1=0.8"], "optim.beta1=0.8 has no effect"),
    (["--optim.name=sgd", "--optim.eps=1e-6"], "optim.eps=1e-06 has no effect"),
    (["--optim.decay_fraction=0.3"], "optim.decay_fraction=0.3 has no effect"),
    (["--optim.schedule=constant", "--optim.total_steps=50"], "optim.total_steps=50 has no effect"),
    (["--optim.warmup_steps=0", "--optim.warmup_type=log"], "optim.warmup_type='log' has no effect"),
    (["--precision.hysteresis=2"], "precision.hysteresis=2 has no effect"),
    (["--optim.name=lion"], "optim.name='lion' is unknown"),
    (["--optim.name=sgd", "--optim.nesterov=true"], "optim.nesterov=true needs optim.momentum > 0"),
])
def test_settings_an_optimizer_cannot_use_are_refused(tmp_path, extra, match):
    cfg = load_config(None, ["--model.preset=tiny", f"--run.out_dir={tmp_path}", *extra])
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg, 2)


def test_settings_of_the_chosen_optimizer_are_accepted(tmp_path):
    for extra in (["--optim.name=sgd", "--optim.momentum=0.9", "--optim.nesterov=true", "--optim.schedule=wsd",
                   "--optim.decay_fraction=0.3"],
                  ["--optim.name=adagrad", "--optim.eps=1e-6", "--optim.warmup_type=log"],
                  ["--precision.dtype=fp16", "--precision.hysteresis=2", "--precision.min_loss_scale=4",
                   "--parallel.zero_stage=1", "--zero.offload=disk", "--optim.name=adam"],
                  ["--parallel.zero_stage=3", "--zero.offload=disk", "--optim.name=adagrad"]):
        validate_config(load_config(None, ["--model.preset=tiny", f"--run.out_dir={tmp_path}", *extra]), 2)


# optimizer: (its settings, [(world, layout args)] compared with one process, resume layout or None)
OPTIMIZERS = {
    "adam": (["--optim.name=adam"], [(2, ["--parallel.zero_stage=2", "--zero.bucket_mb=0.01"])], None),
    "sgd": (["--optim.name=sgd", "--optim.momentum=0.9", "--optim.nesterov=true", "--optim.lr=0.05"],
            [(2, ["--parallel.zero_stage=2", "--zero.bucket_mb=0.01"]),
             (2, ["--parallel.pp=2", "--pipeline.schedule=1f1b", "--pipeline.microbatches=2"])], []),
    "adagrad": (["--optim.name=adagrad", "--optim.lr=0.01"], [(2, ["--parallel.zero_stage=3", "--zero.offload=disk"])],
                ["--parallel.zero_stage=1"]),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_single_process(rank_pool, tmp_path, corpus_cache, name):
    """dp2 (DDP) and a ZeRO layout (Adagrad: ZeRO-3 with disk offload's streamed step; SGD also pipeline
    stages) train like one process; SGD momentum (dp2) and Adagrad (ZeRO-1) resume from the single-process run's step-2 checkpoint
    and end where it ends."""
    settings, layouts, resume = OPTIMIZERS[name]

    def args(run, *extra):
        return tiny_args(tmp_path, corpus_cache, steps=4, extra=[*settings, f"--run.name={run}", "--train.eval_every=4",
                                                                 "--data.eval_batches=1", *extra])

    single = run_rank(load_config(None, args("ref", "--checkpoint.every=2")))
    ref = metrics(tmp_path / "ref")
    for i, (world, layout) in enumerate([(2, []), *layouts]):
        results = rank_pool.run(trainer_worker, world, args=args(f"layout{i}", "--checkpoint.save_final=false", *layout))
        assert_like_single_process(results, single, ref, metrics(tmp_path / f"layout{i}"), world)
    if resume is None:
        return
    start = tmp_path / "ref" / "checkpoint" / "step_000002"
    results = rank_pool.run(trainer_worker, 2, args=args("resumed", f"--checkpoint.resume={start}",
                                                         "--checkpoint.save_final=false", *resume))
    assert results[0]["resumed_from_step"] == 2
    assert results[0]["val_loss_end"] == pytest.approx(single["val_loss_end"], rel=1e-5)
    last = [r for r in metrics(tmp_path / "resumed") if r["kind"] == "train"][-1]
    want = [r for r in ref if r["kind"] == "train"][-1]
    assert last["step"] == want["step"] == 4 and last["loss"] == pytest.approx(want["loss"], rel=1e-5)
