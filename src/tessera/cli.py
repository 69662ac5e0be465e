"""``tessera`` command line.

    tessera train [--config FILE] [--deepspeed DS_CONFIG.json] [--nproc N] [--dry-run] [--section.key=value ...]
    tessera plan --model NAME --gpus N --gpu NAME [...]
    tessera prepare INPUT... --out DIR [--tokenizer byte|TOKDIR] [...]
    tessera export CHECKPOINT [--format safetensors|hf|peft] [--merge-lora] [--out FILE.safetensors|DIR]
    tessera generate CHECKPOINT|HFDIR --prompt TEXT [--max-new-tokens N] [--top-p P --temperature T --seed S]
    tessera report RUN [--out FILE.html]

Everything a user can get wrong is checked here, before any rank starts, and reported as one sentence
with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tessera import __version__
from tessera.errors import ConfigError, UserError

EPILOG = """with no --config, --deepspeed, --nproc or layout key, the 3D-parallel demo runs: dp2 x tp2 x pp2 on 8 local
ranks (configs/default.toml)
--dry-run: every check of a launch, then the layout, run folder, each rank's role and the predicted
  memory per rank; starts nothing (any world size, for example --nproc 64 --dry-run)
overrides: any config key as --section.key=value, for example
  --model.preset=tiny --train.steps=50 --parallel.dp_replicate=2 --data.corpus=path/to/texts
sections: run, model, parallel, ddp, optim, data, train, checkpoint, zero, precision, checkpointing,
  tensor_parallel, context_parallel, pipeline, moe, ps (see docs/CONFIG.md)
parameter-server mode: --model.preset=ctr --ps.servers=2 --ps.workers=2 --ps.mode=ssp --ps.staleness=2"""


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, ``tessera: error: …``, with exit code 2."""

    def error(self, message: str):
        self.exit(2, f"tessera: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tessera", allow_abbrev=False,
                     description="Train large models with every form of parallelism.")
    parser.add_argument("--version", action="version", version=f"tessera {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", allow_abbrev=False, help="train a model",
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", help="a TOML file (see configs/); defaults apply where it is silent")
    train.add_argument("--deepspeed", metavar="FILE", help="a DeepSpeed config (JSON) mapped onto tessera's keys: "
                       "after --config, before --section.key overrides, which win (docs/DEEPSPEED.md)")
    train.add_argument("--nproc", type=int, help="local ranks to spawn (sets run.nproc); ignored under "
                       "torchrun, which decides the world size")
    train.add_argument("--dry-run", action="store_true", help="check everything, print the layout, run "
                       "folder, rank roles and predicted memory per rank, and start nothing")
    from tessera.planner.command import add_plan_parser

    add_plan_parser(sub)
    export = sub.add_parser("export", allow_abbrev=False,
                            help="write a checkpoint's weights as one safetensors file or a Hugging Face folder",
                            description="Consolidate a checkpoint written under any parallel layout into "
                                        "one safetensors file of single-process parameter names, or (--format "
                                        "hf) a Hugging Face model folder.")
    export.add_argument("checkpoint", help="a checkpoint folder (runs/<name>/checkpoint/step_<n>)")
    export.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                        help="safetensors (default): tessera's parameter names; hf: config.json + "
                        "model.safetensors that transformers loads, with the run's tokenizer.json; peft: a "
                        "LoRA run's adapter alone (adapter_config.json + adapter_model.safetensors)")
    export.add_argument("--merge-lora", action="store_true",
                        help="a LoRA run: merge its adapters into the base weights (W + scale·B·A), so the "
                        "export is an ordinary model; needed for --format hf")
    export.add_argument("--out", help="the .safetensors file (or, for hf and peft, the folder) to write "
                        "(default: beside the checkpoint folder, <checkpoint>.safetensors, -hf, -peft, or "
                        "-merged.safetensors)")
    from tessera.generate.command import add_generate_parser

    add_generate_parser(sub)
    from tessera.prepare_command import add_prepare_parser

    add_prepare_parser(sub)
    from tessera.observe.report.command import add_report_parser

    add_report_parser(sub)
    return parser


# `tessera train` without a layout of its own: the 3D-parallel demo, dp2 x tp2 x pp2 on 8 local ranks
# (configs/default.toml says the same). Any --config, --nproc, or key of these sections picks the
# layout instead, as does torchrun, which decides the world size.
DEMO_LAYOUT = ["--run.nproc=8", "--parallel.tp=2", "--parallel.pp=2", "--pipeline.schedule=1f1b",
               "--pipeline.microbatches=4"]
LAYOUT_SECTIONS = ("run.nproc", "model.preset", "model.hf", "parallel", "pipeline", "tensor_parallel",
                   "context_parallel", "zero", "precision", "checkpointing", "moe", "ps")


def with_demo_layout(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """``overrides`` preceded by the demo layout when the user chose no layout at all."""
    from tessera.launch import under_torchrun

    keys = [o[2:].split("=", 1)[0] for o in overrides if o.startswith("--")]
    chosen = any(k == s or k.startswith(s + ".") for k in keys for s in LAYOUT_SECTIONS)
    given = (args.config, args.nproc, getattr(args, "deepspeed", None))  # a DeepSpeed config describes a job too
    if any(g is not None for g in given) or chosen or under_torchrun():
        return overrides
    return [*DEMO_LAYOUT, *overrides]


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.launch import env_world_size, under_torchrun
    from tessera.train.config import load_config

    if args.nproc is not None:  # the same as --run.nproc=N, so validation sees it as the user's setting
        overrides = [*overrides, f"--run.nproc={args.nproc}"]
    deepspeed = _read_deepspeed(args.deepspeed)
    cfg = load_config(args.config, with_demo_layout(args, [*(deepspeed.overrides if deepspeed else []), *overrides]))
    if cfg.model_preset == "ctr":  # parameter-server mode: its own server and worker processes (see [ps])
        if deepspeed:
            raise ConfigError("--deepspeed describes a collective job; model.preset=ctr runs the parameter-server one")
        return _train_ctr(cfg, args.dry_run)
    ranked = under_torchrun()  # torchrun made this process one rank and decided the world size
    world = env_world_size() if ranked else cfg.run.nproc
    lead = not ranked or os.environ.get("RANK", "0") == "0"  # under torchrun every rank runs this
    for note in deepspeed.notes if deepspeed and lead else ():  # once, not per rank
        print(note, file=sys.stderr)
    user_keys = {o[2:].split("=", 1)[0] for o in overrides if o.startswith("--")}
    parallel = resolve_job(cfg, world, announce=lead, deepspeed=deepspeed, user_keys=user_keys)
    if lead:
        from tessera.precision.cpu_speed import slow_half_precision_note

        if note := slow_half_precision_note(cfg.run.device, cfg.precision.dtype):
            print(note, file=sys.stderr)
    if args.dry_run:
        return _dry_run(cfg, parallel, world, lead)
    if cfg.run.check_memory:  # the planner's peak per rank against this machine's memory per local rank
        from tessera.train.memory_check import check_memory

        check_memory(cfg, parallel, world, _memory_budget(cfg, world, ranked))
    if ranked:  # the ranks' own load checks the checkpoint, and rank 0 creates the run folder
        from tessera.launch import rank_entry

        summary = rank_entry(cfg)
        if lead:
            print(_report(summary))
        return 0
    summary = _launch(cfg, parallel, world)
    print(_report(summary))  # rank 0's
    return 0


def resolve_job(cfg, world: int, announce: bool = True, deepspeed=None, user_keys=frozenset()):
    """Fill in ``parallel.auto``'s layout, validate everything, and return the resolved ParallelConfig.
    ``cfg.parallel.auto`` is then cleared: the layout is decided, and the run's config.toml repeats it.
    ``deepspeed`` (a DeepSpeedJob) is settled in between: its batch rule needs the data-parallel degree."""
    from tessera.train.config import validate_config

    if cfg.parallel.auto:
        from tessera.train.auto_layout import apply_auto_layout

        chosen = apply_auto_layout(cfg, world)
        if announce:
            print(f"parallel.auto chose {chosen}", file=sys.stderr)
    for note in deepspeed.settle(cfg, world, user_keys) if deepspeed else ():
        if announce:
            print(note, file=sys.stderr)
    validate_config(cfg, world)
    cfg.parallel.auto = False
    return cfg.parallel.resolved(world)


def _read_deepspeed(path: str | None):
    """``--deepspeed FILE`` as a DeepSpeedJob (None without it); its errors are ConfigErrors."""
    if path is None:
        return None
    from tessera.train.deepspeed_json import read_deepspeed

    return read_deepspeed(path)


def _memory_budget(cfg, world: int, ranked: bool):
    """This machine's memory per local rank (under torchrun its LOCAL_WORLD_SIZE ranks share it)."""
    from tessera.train.memory_check import machine_budget

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if ranked else world
    return machine_budget(cfg.run.device, local, ranks_running=ranked)


def _dry_run(cfg, parallel, world: int, lead: bool) -> int:
    """Every check of a launch, then the report; nothing is started or written. Under torchrun every rank
    runs this; only the lead rank reads the checkpoint (it hashes every file), as before a real launch."""
    from tessera.device import resolve_device
    from tessera.launch import under_torchrun
    from tessera.train.dry_run import describe_job
    from tessera.train.resume import check_before_launch
    from tessera.train.rundir import prepare_run_dir

    resolve_device(cfg.run.device)
    resume = check_before_launch(cfg) if lead else None
    run_dir = prepare_run_dir(cfg, parallel, create=False)
    if lead:
        from tessera.train.memory_check import memory_report

        budget = _memory_budget(cfg, world, ranked=under_torchrun())
        print(describe_job(cfg, parallel, world, run_dir, resume, memory_report(cfg, parallel, world, budget)))
    return 0


def _launch(cfg, parallel, world: int) -> dict:
    """Check the checkpoint, the device and the run folder (created here, so ranks never meet a folder that
    cannot be made), build the token cache once, then train on ``world`` local ranks."""
    from tessera.device import resolve_device
    from tessera.launch import launch_local, run_rank
    from tessera.train.data import load_corpus
    from tessera.train.resume import check_before_launch
    from tessera.train.rundir import prepare_run_dir

    check_before_launch(cfg)
    resolve_device(cfg.run.device)
    prepare_run_dir(cfg, parallel)
    load_corpus(cfg.data, progress=cfg.run.progress)  # build the token cache once, before ranks start
    return launch_local(cfg, world) if world > 1 else run_rank(cfg)


def _train_ctr(cfg, dry_run: bool) -> int:
    """The parameter-server job: validated like any job, then checked as only it needs (not under torchrun;
    ``ps.address`` an address of this machine; ``ps.resume`` a folder of tables) before its run folder goes
    under ``run.out_dir``. A dry run makes the same checks, so it refuses what the real run would."""
    from tessera.launch import under_torchrun
    from tessera.parameter_server.network import listen_interface
    from tessera.train.config import validate_config
    from tessera.train.dry_run import describe_ctr_job
    from tessera.train.rundir import prepare_folder

    if under_torchrun():
        raise ConfigError("the parameter-server mode (model.preset=ctr) starts its own processes: "
                          "run it without torchrun")
    validate_config(cfg, 1)
    interface = listen_interface(cfg.ps.address)  # the one look-up of this machine's interfaces
    if cfg.ps.resume:
        from tessera.parameter_server.server import latest_complete

        latest_complete(cfg.ps.resume, cfg.ps.servers)
    out_dir = prepare_folder(Path(cfg.run.out_dir), create=not dry_run)
    if dry_run:
        print(describe_ctr_job(cfg, out_dir))
        return 0
    from tessera.train.ps_run import train_ctr

    print(json.dumps(train_ctr(cfg, interface), indent=2))
    return 0


def _report(summary: dict) -> str:
    keep = ("run_dir", "layout", "steps", "val_loss_start", "val_loss_end", "seconds")
    return json.dumps({k: summary[k] for k in keep if k in summary}, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # train's config overrides (--section.key=value) are free-form, so argparse leaves them over; any
    # other command takes only what its parser declares, as parse_args would insist (said as one sentence)
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, rest)
        if rest:
            raise UserError(f"tessera {args.command} does not take {' '.join(rest)}; "
                            f"see tessera {args.command} --help")
        if args.command == "export" and (args.format != "safetensors" or args.merge_lora):
            from tessera.generate.export_hf import export_model_command

            return export_model_command(args.checkpoint, args.out, args.format, args.merge_lora)
        if args.command == "export":
            from tessera.checkpoint import export_command

            return export_command(args.checkpoint, args.out)
        if args.command == "generate":
            from tessera.generate.command import cmd_generate

            return cmd_generate(args)
        if args.command == "prepare":
            from tessera.prepare_command import cmd_prepare

            return cmd_prepare(args)
        if args.command == "report":
            from tessera.observe.report.command import cmd_report

            return cmd_report(args)
        if args.command == "plan":
            from tessera.planner.command import cmd_plan

            return cmd_plan(args)
    except UserError as err:
        print(f"tessera: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("tessera: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a failed rank: its own traceback is already on stderr
        from tessera.spawn import RankFailed

        if isinstance(err, RankFailed):
            print(f"tessera: error: {err}", file=sys.stderr)
            return err.exit_code
        raise
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
