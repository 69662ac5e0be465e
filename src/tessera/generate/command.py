"""``tessera generate MODEL --prompt TEXT --max-new-tokens N [--top-p P --temperature T --seed S]``.

MODEL is a Hugging Face folder (with its tokenizer.json) or a tessera checkpoint (its run's tokenizer).
Greedy decoding unless --top-p or --temperature is given. One process, one device, batch 1.
"""

from __future__ import annotations

import argparse

from tessera.errors import UserError
from tessera.generate.sampling import Sampling


def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", allow_abbrev=False, help="continue a prompt with a trained or imported model",
                       description="Decode a continuation of --prompt with a KV cache: greedy by default, "
                                   "top-p sampling with --top-p/--temperature. One process holds the whole "
                                   "model (batch 1).")
    p.add_argument("model", help="a Hugging Face model folder (config.json, safetensors, tokenizer.json) or a "
                   "tessera checkpoint (runs/<name>/checkpoint[/step_<n>]; the folder means its newest)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to add at most (default 32); "
                   "decoding also ends at the tokenizer's end-of-text token")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens holding this much "
                   "probability (default 1.0 once sampling)")
    p.add_argument("--temperature", type=float, help="divide the logits by this before sampling (default "
                   "1.0 once sampling; 0 = greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling draws (default 0)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="where the model runs (default cpu)")
    return p


def sampling_of(args: argparse.Namespace) -> Sampling:
    """Greedy unless --top-p or --temperature is given; then each defaults to 1.0."""
    if args.top_p is None and args.temperature is None:
        return Sampling()
    return Sampling(temperature=1.0 if args.temperature is None else args.temperature,
                    top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed).validate()


def cmd_generate(args: argparse.Namespace) -> int:
    """Prints the decoded continuation (without a final end-of-text token); returns 0."""
    from tessera.device import resolve_device
    from tessera.generate.decode import generate
    from tessera.generate.run_model import load_run_model

    sampling = sampling_of(args)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    loaded = load_run_model(args.model, resolve_device(args.device))
    prompt_ids = loaded.encode_prompt(args.prompt)
    new = generate(loaded.model, prompt_ids, args.max_new_tokens, sampling, loaded.stop_ids)
    if new and new[-1] in loaded.stop_ids:
        new = new[:-1]
    print(loaded.tokenizer.decode(new))
    return 0
