"""Sampling continuations from a trained model."""

from __future__ import annotations

import math

import torch

from tenx.errors import TenxError
from tenx.model.transformer import Transformer


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Refuse sampling settings that make no sense, naming the flag."""
    if max_new_tokens < 0:
        raise TenxError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise TenxError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}")
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
    check_sampling(max_new_tokens, temperature, top_k)
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
