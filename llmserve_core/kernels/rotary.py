"""The neox rotary reference the fused q/k kernel (kernels/qk_norm_rope.py) is tested against.

cos/sin: [max_positions, head_dim // 2] (layers/rotary.py's buffers). The pair (i, i + head_dim/2) is
rotated in float32 and rounded once, as the kernel does.
"""
from __future__ import annotations

import torch


def rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, Hq, D] and k [T, Hk, D], computed in float32."""
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return rot(q), rot(k)
