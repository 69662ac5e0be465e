"""``tessera plan``: its arguments and what it prints (the CLI glue; the planner itself is pure)."""

from __future__ import annotations

import argparse
import json

from tessera.errors import ConfigError

PLAN_EPILOG = """examples:
  tessera plan --model llama3-70b --gpus 512 --gpu h100 --global-batch 512
  tessera plan --model gpt3-175b --gpus 1024 --gpu a100-80gb --global-batch 1536 --json
  tessera plan --model llama3-70b --gpus 8 --gpu h100 --global-batch 64 --seq 4096 --lora-rank 16
  tessera plan --calibrate --model tessera-small --gpus 2 --global-batch 16 --seq 128 --precision fp32"""


def add_plan_parser(sub) -> argparse.ArgumentParser:
    """Register ``plan`` on the CLI's sub-parsers."""
    p = sub.add_parser("plan", allow_abbrev=False, help="predict memory and step time, rank layouts",
                       epilog=PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="catalogue model (gpt3-*, llama2-*, llama3-*, tessera-<preset>)")
    p.add_argument("--gpus", type=int, help="GPUs (ranks) in the cluster; default 8, or 2 with --calibrate")
    p.add_argument("--gpu", default="a100-80gb", help="catalogue GPU: a100-40gb, a100-80gb, h100, h200")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 512)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--precision", default="mixed", choices=("mixed", "fp32"))
    p.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    p.add_argument("--top", type=int, default=10, help="layouts to show")
    p.add_argument("--json", action="store_true", help="print the ranked layouts as JSON")
    p.add_argument("--set-gpu", action="append", metavar="FIELD=VALUE", help="override a GPU field")
    p.add_argument("--set-model", action="append", metavar="FIELD=VALUE", help="override a model field")
    p.add_argument("--lora-rank", type=int, help="fine-tune with LoRA adapters of this rank (lora.rank); the "
                                                  "base weights frozen")
    p.add_argument("--lora-targets", metavar="NAMES",
                   help="comma-separated linears the adapters sit on (lora.targets; default wq,wk,wv,wo)")
    p.add_argument("--spec-file", help='JSON {"gpu": {...}, "model": {...}} of field overrides')
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's matmul rate and all-reduce α, β on local ranks and plan with them")
    p.add_argument("--calibration", help="a JSON file written by --save-calibration, used instead of measuring")
    p.add_argument("--save-calibration", help="write the measured numbers to this JSON file")
    p.add_argument("--validate", action="store_true",
                   help="predict every published GPU run of the planner's table (src/tessera/planner/"
                        "published_runs.json) on its own layout and print predicted against published")
    p.add_argument("--write-doc", metavar="FILE",
                   help="with --validate: also replace the published-runs table in this markdown file "
                        "(docs/PLANNER.md)")
    return p


def _gpu_and_model(args):
    from tessera.planner.catalog import get_gpu, get_model, load_spec_file, parse_overrides
    from tessera.planner.local import local_gpu

    gpu_file, model_file = load_spec_file(args.spec_file) if args.spec_file else ({}, {})
    lora = {"lora_rank": args.lora_rank} if args.lora_rank is not None else {}
    if args.lora_targets is not None:
        lora["lora_targets"] = args.lora_targets
    model = get_model(args.model, **{**model_file, **parse_overrides(args.set_model), **lora})
    calibration = _calibration(args)
    if calibration is not None:
        gpu = local_gpu(args.gpus, calibration)
    else:
        gpu = get_gpu(args.gpu, **{**gpu_file, **parse_overrides(args.set_gpu)})
    return gpu, model, calibration


def _calibration(args) -> dict | None:
    if args.calibration:
        try:
            with open(args.calibration) as fh:
                return json.load(fh)
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read the calibration file {args.calibration}: {err}") from None
    if not args.calibrate:
        return None
    from tessera.planner.calibrate import calibrate

    result = calibrate(world=2)
    if args.save_calibration:
        with open(args.save_calibration, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the ranked layouts (or JSON), each with the ``tessera train`` flags that run it; only layouts
    the trainer accepts are ranked. ConfigError/NoLayoutFits propagate to the CLI's one-sentence handler."""
    from tessera.planner.explain import as_json, explain
    from tessera.planner.search import search
    from tessera.planner.trainable import TrainerRule, job_flags

    if args.validate:
        return _validate(args)
    if args.write_doc:
        raise ConfigError("--write-doc goes with --validate")
    if args.gpus is None:
        args.gpus = 2 if (args.calibrate or args.calibration) else 8
    if args.model is None:
        if args.calibrate:
            print(json.dumps(_calibration(args), indent=2))
            return 0
        raise ConfigError("tessera plan needs --model (for example --model llama3-8b)")
    if args.top < 1:
        raise ConfigError(f"--top must be a positive integer, got {args.top}")
    gpu, model, calibration = _gpu_and_model(args)
    from tessera.planner.published import band_source, step_band

    band, source = step_band(gpu), band_source(gpu)
    batch, seq = (args.global_batch if args.global_batch is not None else 512), args.seq or model.seq
    rule = TrainerRule(job_flags(model, batch, seq, args.precision), batch)
    plan = search(model, gpu, args.gpus, batch, seq, precision=args.precision, optimizer=args.optimizer,
                  top=args.top, rule=rule)
    if args.json:
        print(json.dumps({"model": model.name, "gpu": gpu.name, "gpus": args.gpus, "global_batch": batch,
                          "seq": seq, "calibration": calibration, "considered": plan.considered,
                          "fitting": plan.fitting, "refused": len(plan.refused),
                          "band_source": source,
                          "layouts": [{**as_json(e, band), "train_flags": rule.flags + rule.layout_flags(e.layout)}
                                      for e in plan.ranked]}, indent=2))
        return 0
    n = model.num_params()
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    head = (f"{model.name} ({size} parameters) on {args.gpus} x {gpu.name}, "
            f"global batch {batch} x {seq} tokens, {args.precision} precision")
    if model.lora_rank:
        head += (f", LoRA rank {model.lora_rank} on {','.join(model.lora_targets)} "
                 f"({model.adapter_params() / 1e6:.2f}M trainable, the rest frozen)")
    print(head + "\n" + explain(plan, args.gpus, flags=(rule.flags, [rule.layout_flags(e.layout) for e in plan.ranked]),
                                band=band, band_source=source))
    return 0


def _validate(args) -> int:
    """``--validate``: the published-runs table (and, with ``--write-doc``, that table in the doc)."""
    from tessera.planner.mfu_check import report
    from tessera.planner.published import sources, table, write_doc

    text = table() + "\n\n" + report()
    print(text)
    print("\nsources:\n" + "\n".join(f"- {s}" for s in sources()))
    if args.write_doc:
        write_doc(args.write_doc, text)
        print(f"wrote the table into {args.write_doc}")
    return 0
