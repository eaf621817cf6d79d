"""The exponential race of kernels/sampling.py in torch ops: what the CPU runs, and what the kernel is tested
against. Torch only, so a CPU install without Triton samples too."""
from __future__ import annotations

import torch


def race_argmax_reference(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits [N, V], temperature [N] (0: greedy), noise [N, V] Exp(1) -> tokens [N] int64: argmax(logits / T
    - log E), NaN scores as -inf, the argmax of the logits where no score is finite."""
    logit = logits.float()
    logit = torch.where(logit.isnan(), float("-inf"), logit)
    temperature = temperature.float()
    inv = torch.where(temperature > 0, 1.0 / temperature.clamp_min(1e-30), torch.zeros_like(temperature))
    score = torch.where(temperature[:, None] > 0, logit * inv[:, None] - noise.log(), logit)
    score = torch.where(score.isnan(), float("-inf"), score)
    top, token = score.max(dim=1)
    return torch.where(torch.isfinite(top), token, logit.argmax(dim=1))
