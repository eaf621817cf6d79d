"""The one switch for the fast path: Triton kernels in the models and CUDA graphs in the runners.

Both need a CUDA device and an attention backend whose kernels read every length from device tensors
(so a captured graph replays correctly with new lengths). The torch backend keeps the whole model eager:
it is the reference every fast path is tested against. --enforce-eager turns the graphs off alone.
"""
from __future__ import annotations

import os

import torch


def fast_path(device, attn_backend) -> bool:
    return torch.device(device).type == "cuda" and getattr(attn_backend, "name", "torch") != "torch"


def use_pdl(device, attn_backend) -> bool:
    """On the fast path on Hopper or later, a batch-1 decode layer runs as a chain of Triton kernels launched
    with PDL (kernels/pdl.py), the projections in kernels/stream_gemv.py instead of cuBLAS.
    LLMSERVE_PDL=0 keeps cuBLAS and plain launches (benchmarks time both in one run)."""
    if not fast_path(device, attn_backend) or os.environ.get("LLMSERVE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(torch.device(device))[0] >= 9


def use_cuda_graphs(device, attn_backend, enforce_eager: bool) -> bool:
    """Whether the runners replay their fixed-shape forwards from graphs (engine/step_graphs.py). On a device
    that cannot capture, LLMSERVE_CPU_STEP_GRAPHS=1 turns on the same bookkeeping with the forwards run
    eagerly (StepGraphs' capture=False): the tests' way to check the graph path without a GPU. It is read
    from the environment so that spawned tensor-parallel workers see it too."""
    if enforce_eager:
        return False
    if torch.device(device).type != "cuda":
        return os.environ.get("LLMSERVE_CPU_STEP_GRAPHS") == "1"
    return fast_path(device, attn_backend)
