"""Triton decode with FlashAttention-4 prefill and extend: each side where it is faster.

On the H200 (benchmarks/results/kernels_h200_run1.md) Triton's split-KV decode beats FA4 (which has no
split-KV on SM90) by up to 5x at batch 1, while FA4's TMA and warp-specialized prefill beats Triton's
(0.70x and 0.65x on 8 x 512 prefill and a 4 x 1,024 extend). One predicate, `use_fa4`, sends a step to
FA4; everything else takes the Triton path, so this backend does whatever the Triton one does:

- decode steps (one query row per sequence, the CUDA-graph case) stay on Triton;
- a speculative tree mask needs the Triton kernel (FA4's varlen interface takes none);
- a speculative verify or draft catch-up (the same few rows for every sequence, `uniform_query_len`)
  takes Triton's decode kernel over those rows, which reads the KV once per sequence;
- other short query rows stay on Triton below FA4_MIN_QUERY_LEN, where FA4's 128-row tiles are mostly
  padding; benchmarks/kernels_bench.py times both at such shapes;
- anything being captured into a CUDA graph stays on Triton, whose launches read every length from
  device tensors (the verify graphs);
- float32, and head sizes FA4's SM90 forward does not cover (over 128, or not a multiple of 8), stay on
  Triton.

FA4 reads whole pages, so cache rows past a sequence's length must be finite (the runner zero-fills
the cache). Pages of any size work (16 takes FA4's non-TMA paged path, 128 its TMA path).
"""
from __future__ import annotations

import torch

from llmserve_core.layers.attention.base import AttentionBackend
from llmserve_core.layers.attention.flash_attn_backend import fa4_paged, load_fa4
from llmserve_core.layers.attention.triton_backend import TritonAttentionBackend
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.kernels.fp8_format import RowQuant

FA4_MIN_QUERY_LEN = 16
FA4_DTYPES = (torch.bfloat16, torch.float16)
FA4_ARCHS = (9, 10, 11)
FA4_MAX_HEAD_DIM = 128     # the head sizes its SM90 forward is built and tuned for: 64, 96, 128


def use_fa4(dtype: torch.dtype, head_dim: int, batch: ForwardBatch, capturing: bool) -> bool:
    """The one predicate that sends a step's attention to FlashAttention-4 instead of Triton."""
    return (dtype in FA4_DTYPES and head_dim <= FA4_MAX_HEAD_DIM and head_dim % 8 == 0 and batch.tree_mask is None
            and not batch.uniform_query_len and batch.max_query_len >= FA4_MIN_QUERY_LEN and not capturing)


class TritonFA4Backend(AttentionBackend):
    name = "triton-fa4"

    def __init__(self):
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] not in FA4_ARCHS:
            raise ImportError(f"FlashAttention-4 builds for SM90 / SM100 / SM110, not this card's "
                              f"SM{''.join(map(str, torch.cuda.get_device_capability()))}")
        self.fa4 = load_fa4()
        self.triton = TritonAttentionBackend()

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False,
               quant: RowQuant | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        # FA4 reads caches of the model's dtype; an FP8 cache stays on the Triton kernels.
        if k_cache.dtype != q.dtype or not use_fa4(q.dtype, q.shape[-1], batch, capturing):
            return self.triton.attend(q, k_cache, v_cache, batch, scale, k_scale, v_scale, pdl, quant)
        return fa4_paged(self.fa4, q, k_cache, v_cache, batch, scale)
