"""Sampling continuations from a trained model."""

from __future__ import annotations

import math

import torch

from tenx.errors import TenxError
from tenx.model.transformer import Transformer

MAX_NEW_TOKENS = 100_000
"""The most tokens one `tenx sample` generates (each is a forward pass over up to seq_len tokens)."""
MAX_SEED = 2**63 - 1
"""The largest seed torch.Generator.manual_seed takes."""


MAX_TEMPERATURE = 1000.0
"""The highest sampling temperature (above it the fp32 logits divided by it lose all difference anyway)."""


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, seed: int = 0) -> None:
    """Refuse sampling settings that make no sense, naming the flag."""
    if not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise TenxError(f"--max-new-tokens must be in [0, {MAX_NEW_TOKENS:,}], got {max_new_tokens}")
    if not 0 <= seed <= MAX_SEED:
        raise TenxError(f"--seed must be in [0, 2**63 - 1], got {seed}")
    if not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise TenxError(
            f"--temperature must be a number from 0 (greedy) to {MAX_TEMPERATURE:g} (as good as uniform), "
            f"got {temperature}"
        )
    if top_k is not None and top_k < 0:
        raise TenxError(f"--top-k must be >= 0 (0: all tokens), got {top_k}")


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 50,
    stop_id: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
) -> list[int]:
    """Continue `prompt_ids` by sampling; temperature 0 is greedy. Stops early at `stop_id`.

    `vocab_size` masks the padding ids above the tokenizer's vocabulary.
    """
    check_sampling(max_new_tokens, temperature, top_k, seed)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new: list[int] = []
    model.eval()
    for _ in range(max_new_tokens):
        context = ids[:, -model.cfg.seq_len :]
        logits_V = model(context)[0, -1].float()
        if vocab_size is not None:
            logits_V[vocab_size:] = float("-inf")
        if temperature <= 0:
            next_id = int(logits_V.argmax())
        else:
            logits_V = logits_V / temperature
            if top_k and top_k < logits_V.numel():
                cutoff = torch.topk(logits_V, top_k).values[-1]
                logits_V = logits_V.masked_fill(logits_V < cutoff, float("-inf"))
            probs = torch.softmax(logits_V, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=generator))
        if stop_id is not None and next_id == stop_id:
            break
        new.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
    return new
