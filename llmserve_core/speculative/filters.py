"""Turn target logits into the distribution a request actually samples from.

Speculative verification is lossless only if it compares drafts against exactly the distribution the
plain sampler would draw from, so the sampler and the verifier share this one function.
Order follows vLLM: temperature, then min_p (on the tempered distribution), then top_k, then top_p.
A temperature of 0 gives a one-hot row at the argmax, which makes rejection sampling reduce to
greedy verification for greedy requests in a mixed batch.
"""
from __future__ import annotations

import torch


def apply_sampling_filters(
    logits: torch.Tensor,       # [N, V]
    temperature: torch.Tensor,  # [N] float, 0 = greedy
    top_k: torch.Tensor,        # [N] int, <= 0 disables
    top_p: torch.Tensor,        # [N] float in (0, 1], 1 disables
    min_p: torch.Tensor,        # [N] float in [0, 1], 0 disables
) -> torch.Tensor:              # [N, V] float32 probabilities
    logits = logits.float()
    n, vocab = logits.shape
    device = logits.device
    temperature = temperature.to(device=device, dtype=torch.float32)
    greedy = temperature <= 0.0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]

    min_p = min_p.to(device=device, dtype=torch.float32)
    if bool((min_p > 0).any()):
        probs = torch.softmax(scaled, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))

    top_k = top_k.to(device=device, dtype=torch.long)
    top_p = top_p.to(device=device, dtype=torch.float32)
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if bool(use_k.any()):
            k = torch.where(use_k, top_k, torch.full_like(top_k, vocab))
            drop |= torch.arange(vocab, device=device)[None, :] >= k[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        if bool(use_p.any()):
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p: a token goes when the mass before it
            # already reaches top_p. The first token always stays.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= (mass_before >= top_p[:, None]) & use_p[:, None]
            drop[:, 0] = False
        scaled = scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))

    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """One token per row. Rows with a generator draw only from it, so a seeded request gives the
    same tokens whatever else shares its batch. Exponential race: argmax p / E with E ~ Exp(1)."""
    noise = torch.empty_like(probs, dtype=torch.float32)
    seeded = [i for i, g in enumerate(generators or []) if g is not None]
    if len(seeded) < probs.shape[0]:
        noise.exponential_()
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    # A zero-probability token must never win, even against a huge noise draw.
    return (probs.float() / noise).masked_fill(probs <= 0, -1.0).argmax(dim=-1)
