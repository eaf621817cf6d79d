"""Neox-style rotary position embedding with a cos/sin cache built once and indexed by position.

`rope_inv_freq` reproduces transformers' ROPE_INIT_FUNCTIONS op for op in float32 on the CPU, so the
cache here is bit-identical to the cos/sin transformers computes for the same positions.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def _base_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None,
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling applied to cos and sin)."""
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        # Dynamic NTK only changes the frequencies beyond max_position_embeddings, and the cache stops there.
        return _base_inv_freq(head_dim, rope_theta), 1.0
    if rope_type == "linear":
        return _base_inv_freq(head_dim, rope_theta) / rope_scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(head_dim, rope_theta, rope_scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings)
    raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r}")


def _llama3_inv_freq(dim: int, base: float, s: dict) -> torch.Tensor:
    inv_freq = _base_inv_freq(dim, base)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, base: float, s: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original_max = s["original_max_position_embeddings"]
    factor = s.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Holds cos and sin [max_positions, head_dim // 2] in the model dtype; `forward` rotates q and k."""

    def __init__(self, head_dim: int, max_positions: int, rope_theta: float, rope_scaling: dict | None,
                 max_position_embeddings: int, dtype: torch.dtype, device):
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scaling = rope_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings)
        # Same float32 ops as transformers' rotary forward, then cast once to the model dtype as it does.
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos", (freqs.cos() * scaling).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling).to(device=device, dtype=dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token [T, 1, head_dim // 2] rows, gathered once per forward and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] by neox pairing (i, i + head_dim / 2)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
