"""SiLU-and-multiply over a packed [gate | up] projection (one matmul instead of two)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] laid out as [gate | up] -> silu(gate) * up, [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
