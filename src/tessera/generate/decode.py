"""Autoregressive decoding of one sequence with a KV cache: the prompt in one forward, then one token
per forward, each at its absolute position.

Batch 1 only: one prompt, no padding. A mixture-of-experts layer routes in eval mode; built with
``drop_tokens=False`` (as ``run_model`` builds it, and as Mixtral is) every token reaches its top-k
experts, so a token's logits do not depend on how many tokens share its forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from tessera.errors import UserError
from tessera.generate.kv_cache import KVCache
from tessera.generate.sampling import Sampling, next_token


def check_lengths(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> None:
    """UserError (one sentence) unless the prompt and the new tokens fit the model's positions."""
    if prompt_len < 1:
        raise UserError("the prompt is empty after tokenisation; give at least one token of text")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > max_seq_len:
        room = max_seq_len - prompt_len
        advice = (f"ask for at most {room} new tokens" if room > 0 else "shorten the prompt")
        raise UserError(f"the prompt ({prompt_len} tokens) and {max_new_tokens} new tokens exceed the model's "
                        f"max_seq_len of {max_seq_len}; {advice}")


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_ids: Iterable[int] = ()) -> list[int]:
    """The ids of up to ``max_new_tokens`` tokens that follow ``prompt_ids`` under the whole one-device
    ``model`` (a ``tessera.models.Transformer``, put in eval mode); ends early after a token of
    ``stop_ids``, which is included (as ``transformers``' ``generate`` includes its eos)."""
    check_lengths(len(prompt_ids), max_new_tokens, model.cfg.max_seq_len)
    sampling.validate()
    model.eval()
    stop = set(int(t) for t in stop_ids)
    device = model.tok_embeddings.weight.device
    cache = KVCache.for_model(model, batch=1, max_len=len(prompt_ids) + max_new_tokens)
    generator = torch.Generator().manual_seed(sampling.seed)  # CPU: the same draws on every device
    tokens_BS = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    new: list[int] = []
    while True:
        logits_V = model(tokens_BS, cache=cache)[0, -1]
        new.append(next_token(logits_V, sampling, generator))
        if new[-1] in stop or len(new) == max_new_tokens:
            return new
        tokens_BS = torch.tensor([[new[-1]]], dtype=torch.long, device=device)
