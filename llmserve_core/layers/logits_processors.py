"""Edits to the logits before sampling: logit_bias, min_tokens, penalties, grammar masks (vLLM's order).

All of it runs on the device for the whole batch at once: a step builds one `LogitsProcessors` (only the
parts some row needs) and `apply` turns the model's logits into the ones the sampler draws from.
Penalties follow vLLM: repetition_penalty over tokens seen in the prompt or the output (positive logits
divided, negative multiplied), then frequency (times the output count) and presence (once per output
token seen) subtracted. The grammar mask comes last, so nothing can lift a forbidden token back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    rows: torch.Tensor              # [R] rows of the batch with a penalty
    presence: torch.Tensor          # [R] float32
    frequency: torch.Tensor         # [R] float32
    repetition: torch.Tensor        # [R] float32
    output_ids: torch.Tensor        # [R, L] int64 output tokens, padded with vocab (a dropped column)
    prompt_ids: torch.Tensor | None  # [R, P] int64 prompt tokens (padded likewise); None: no repetition penalty


@dataclass
class TokenMask:
    rows: list[int]                 # rows the bitmask applies to (the others' bitmask rows are unused)
    bitmask: torch.Tensor           # [N, ceil(V / 32)] int32, bit j of word w allows token 32 w + j


@dataclass
class LogitsProcessors:
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (rows, token ids, values)
    blocked: tuple[torch.Tensor, torch.Tensor] | None = None              # (rows, token ids) set to -inf
    penalties: Penalties | None = None
    mask: TokenMask | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of logits [N, V] with every edit applied."""
        out = logits.float().clone()
        if self.bias is not None:
            rows, tokens, values = self.bias
            out.index_put_((rows, tokens), values, accumulate=True)
        if self.blocked is not None:
            out[self.blocked] = float("-inf")
        if self.penalties is not None:
            p = self.penalties
            out[p.rows] = apply_penalties(out[p.rows], p)
        if self.mask is not None:
            apply_token_bitmask(out, self.mask.bitmask, self.mask.rows)
        return out


def token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, L] ids padded with `vocab` -> [R, V] float32 occurrence counts (the padding column dropped)."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    vocab = logits.shape[-1]
    counts = token_counts(p.output_ids, vocab)
    seen = counts > 0
    if p.prompt_ids is not None:
        seen_any = seen | (token_counts(p.prompt_ids, vocab) > 0)
        rep = p.repetition[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen_any, penalized, logits)
    return logits - p.frequency[:, None] * counts - p.presence[:, None] * seen.float()


def bitmask_to_bool(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, W] int32 packed bits -> [M, vocab] bool (the torch reference for the mask kernels)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    allowed = bitmask_to_bool(bitmask[rows], logits.shape[-1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf in place. On CUDA xgrammar's kernel does it in one
    pass over the rows (tested against the reference above); elsewhere the torch reference."""
    if logits.device.type == "cuda":
        import xgrammar
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
        return
    apply_token_bitmask_reference(logits, bitmask, rows)
