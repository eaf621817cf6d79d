"""Turning draft logits into proposed tokens (in target ids), with the distribution they came from.

Verification only needs q to be the distribution a draft token was actually drawn from, so any q keeps
sampling lossless; drawing drafts with the request's own temperature / top-k / top-p / min-p makes q
close to p and acceptance high. Greedy requests (and greedy accept mode) propose the argmax.
"""
from __future__ import annotations

import torch

from llmserve_core.layers.sampler import SamplingTensors, draw, sampling_probs


def to_target_space(draft_logits: torch.Tensor, d2t: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[N, draft_vocab] -> [N, vocab], -inf where the draft vocabulary has no token."""
    if d2t is None or (draft_logits.shape[1] == vocab_size and not bool(d2t.any())):
        return draft_logits
    out = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
    out[:, torch.arange(draft_logits.shape[1], device=draft_logits.device) + d2t] = draft_logits
    return out


def greedy_propose(draft_logits: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Argmax draft token of each row, as a target id."""
    ids = draft_logits.argmax(dim=-1)
    return ids if d2t is None else ids + d2t[ids]


def topk_propose(draft_logits: torch.Tensor, k: int, d2t: torch.Tensor | None) -> torch.Tensor:
    """The k most likely draft tokens of each row, best first, as target ids [N, k] (tree candidates)."""
    ids = draft_logits.topk(k, dim=-1).indices
    return ids if d2t is None else ids + d2t[ids]


def sample_propose(draft_logits: torch.Tensor, st: SamplingTensors, d2t: torch.Tensor | None,
                   vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one draft token per row with that row's sampling parameters: (target ids [N], q [N, vocab]).
    Greedy rows get their argmax and a one-hot q. A seeded row draws with the noise the target's row
    for the same position uses (st's positions are the proposed tokens'), so it proposes the target's
    own choice wherever q and p agree on it."""
    logits = to_target_space(draft_logits.float(), d2t, vocab_size)
    q = sampling_probs(logits, st)
    greedy = st.temperature == 0
    if bool(greedy.any()):
        one_hot = torch.zeros_like(q).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        q = torch.where(greedy[:, None], one_hot, q)
    return draw(q, st.noise_keys()), q
