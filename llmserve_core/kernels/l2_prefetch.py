"""Ask L2 for a weight the next kernel reads, from the programs of a kernel that leaves DRAM idle.

A batch-1 decode layer's attention reads about 2 MB of K/V in some 6 us: it waits on latency while DRAM
idles, and the o_proj GEMV after it then streams its whole weight from DRAM. Issued by the attention's
programs (one `prefetch.global.L2` per 128-byte line, split over every program of the grid, the idle
pieces of a short context included), the weight arrives in L2 while the attention runs, and o_proj reads
it from there. The programs wait for none of it. (An earlier try, 12c053a, prefetched from kernels of its
own on a side stream; those kernels cost the step more than the faster reads saved.)

A prefetch changes no value anywhere; it is inline PTX, so it runs on CUDA only, and the wrappers pass no
tensor to prefetch in Triton's interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE = tl.constexpr(128)   # bytes one L2 prefetch brings in
LINES_PER_ROUND = 512      # lines a program asks for at a time (4 per thread of a 4-warp program)


@triton.jit
def prefetch_share(ptr, n_lines, program, programs, LINES: tl.constexpr):
    """Program `program` of `programs` asks L2 for its share of the n_lines 128-byte lines from ptr (a byte
    pointer): rounds of LINES lines, the programs of a round side by side."""
    for start in range(program * LINES, n_lines, programs * LINES):
        # The asm takes no mask: lines past the end ask for the last one again.
        idx = tl.minimum(start + tl.arange(0, LINES), n_lines - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptr + idx.to(tl.int64) * LINE],
                                  dtype=tl.int32, is_pure=False, pack=1)


def prefetch_lines(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(t's bytes, how many 128-byte lines they span), as a kernel taking `prefetch_share` wants them."""
    assert t.is_contiguous(), "prefetch: a contiguous tensor"
    return t.view(-1).view(torch.uint8), triton.cdiv(t.numel() * t.element_size(), LINE)
