"""The one switch for the fast path: Triton kernels in the models and CUDA graphs in the runners.

Both need a CUDA device and an attention backend whose kernels read every length from device tensors
(so a captured graph replays correctly with new lengths). The torch backend keeps the whole model eager:
it is the reference every fast path is tested against. --enforce-eager turns the graphs off alone.
"""
from __future__ import annotations

import torch


def fast_path(device, attn_backend) -> bool:
    return torch.device(device).type == "cuda" and getattr(attn_backend, "name", "torch") != "torch"


def use_cuda_graphs(device, attn_backend, enforce_eager: bool) -> bool:
    return fast_path(device, attn_backend) and not enforce_eager
