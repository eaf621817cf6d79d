"""Warm the L2 cache with a tensor that kernels later on the stream will read: one `prefetch.global.L2`
per 128-byte line, from a few programs, on a side stream.

A batch-1 decode layer leaves DRAM idle while its short kernels run (the norms, q/k norm + rotary,
attention) and while its short GEMVs fill and drain. A weight prefetched in those gaps is read from L2 by
its GEMV. The prefetch changes no value anywhere (its torch reference is doing nothing); it is inline PTX,
so it runs on CUDA only, never in Triton's interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE = 128            # bytes an L2 prefetch brings in
PROGRAMS = 32         # few: the prefetch issues requests and waits for none of them
LINES_PER_ROUND = 1024


@triton.jit
def _l2_prefetch_kernel(ptr, n_lines, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * LINES
    for start in range(pid * LINES, n_lines, step):
        # The asm takes no mask: lines past the end re-request the last one.
        idx = tl.minimum(start + tl.arange(0, LINES), n_lines - 1)
        line = ptr + idx.to(tl.int64) * 128
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];", "=r,l", [line], dtype=tl.int32,
                                      is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [line], dtype=tl.int32,
                                      is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, evict_last: bool = True) -> None:
    """Ask L2 for every line of a contiguous CUDA tensor (evict_last: keep it over lines loaded with the
    default or evict_first priority)."""
    assert t.is_cuda and t.is_contiguous(), "l2_prefetch: a contiguous CUDA tensor"
    n_lines = triton.cdiv(t.numel() * t.element_size(), LINE)
    if n_lines:
        _l2_prefetch_kernel[(min(PROGRAMS, triton.cdiv(n_lines, LINES_PER_ROUND)),)](
            t.view(-1).view(torch.uint8), n_lines, LINES=LINES_PER_ROUND, EVICT_LAST=evict_last, num_warps=4)
