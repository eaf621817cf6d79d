"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's log-probability given the tokens
before it, read off the hidden states the prefill computes anyway.

The row at position q predicts token q + 1, so a prompt chunk at positions start .. end - 1 scores prompt
tokens start + 1 .. end; the prompt's last row predicts the first output instead, which is sampled.
Positions a request holds already (it was preempted and recomputes its prompt) are not scored again.
The engine keeps a request's scores until its first output, which carries them all; until then the request
does not read the prefix cache, whose hits would skip positions the head must see (vLLM does the same).
Rows go through the head a slice at a time, so a long chunk never holds [chunk, vocab] logits at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve_core.engine.request import Request
from llmserve_core.layers.sampler import SamplerOutput, model_logprobs


@dataclass
class PromptRows:
    """Built while a batch is packed: which of its rows score which prompt tokens."""
    rows: list[int] = field(default_factory=list)        # packed rows whose logits are read
    targets: list[int] = field(default_factory=list)     # the prompt token each row scores
    spans: list[tuple[Request, int, int]] = field(default_factory=list)   # (request, first position, count)
    device_rows: torch.Tensor | None = None              # rows and targets on the device, once packed
    device_targets: torch.Tensor | None = None

    def add(self, req: Request, row: int, start: int, n: int) -> None:
        """The rows of a chunk (n tokens from position `start`, packed from `row` on) that score prompt
        tokens the request still lacks."""
        if req.prompt_logprobs is None:
            return
        first = max(start, len(req.prompt_logprobs))     # the row predicting the first position not held
        end = min(start + n, req.num_prompt_tokens - 1)
        if first >= end:
            return
        self.rows.extend(range(row + first - start, row + end - start))
        self.targets.extend(req.prompt_token_ids[first + 1:end + 1])
        self.spans.append((req, first + 1, end - first))

    def extras(self) -> tuple:
        """The rows and targets for BatchBuilder.finish to move with the batch; nothing on a step that scores
        no prompt token (nearly every step), so it copies no more than it did without this feature."""
        return (self.rows, self.targets) if self.rows else ()

    def placed(self, device_extras: list[torch.Tensor]) -> None:
        """Take back, on the device, what extras() gave finish."""
        if device_extras:
            self.device_rows, self.device_targets = device_extras

    @property
    def max_k(self) -> int:
        return max(req.params.prompt_logprobs for req, _, _ in self.spans)


def score(compute_logits, hidden: torch.Tensor, prompt: PromptRows, slice_rows: int) -> SamplerOutput:
    """The logprobs of `prompt`'s targets (and the top max_k of each row), from `slice_rows` rows of logits
    at a time; device tensors."""
    k = prompt.max_k
    parts = [model_logprobs(compute_logits(hidden[prompt.device_rows[s:s + slice_rows]]),
                            prompt.device_targets[s:s + slice_rows], k)
             for s in range(0, len(prompt.rows), slice_rows)]
    if len(parts) == 1:
        return parts[0]
    def cat(name: str):
        return None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
    return SamplerOutput(cat("token_ids"), cat("logprobs"), cat("top_logprobs"), cat("top_token_ids"))
