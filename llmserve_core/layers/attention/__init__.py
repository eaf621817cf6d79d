"""Attention backends behind one interface (see base.py); `get_backend` picks one by name."""
from __future__ import annotations

from llmserve_core.layers.attention.base import AttentionBackend
from llmserve_core.layers.attention.torch_ref import TorchAttentionBackend

BACKENDS = ("auto", "torch", "triton", "triton-fa4", "flash-attn")


def get_backend(name: str, device: str) -> AttentionBackend:
    """Resolve `--attention-backend`. 'auto' takes the fastest one that works on `device`: Triton decode
    with FlashAttention-4 prefill where flash_attn.cute imports, else Triton, else torch."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r}, choose from {', '.join(BACKENDS)}")
    if name == "auto":
        name = "torch" if not str(device).startswith("cuda") else _best_cuda_backend()
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from llmserve_core.layers.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if name == "triton-fa4":
        from llmserve_core.layers.attention.triton_fa4_backend import TritonFA4Backend
        return TritonFA4Backend()
    from llmserve_core.layers.attention.flash_attn_backend import FlashAttentionBackend
    return FlashAttentionBackend()


def _best_cuda_backend() -> str:
    try:
        import triton  # noqa: F401
        from llmserve_core.layers.attention import triton_backend  # noqa: F401
    except ImportError:
        return "torch"
    try:
        from llmserve_core.layers.attention.triton_fa4_backend import TritonFA4Backend
        TritonFA4Backend()
        return "triton-fa4"
    except ImportError:
        return "triton"


__all__ = ["AttentionBackend", "TorchAttentionBackend", "get_backend", "BACKENDS"]
