"""A 16-bit query tile brought into float16 for products with an FP8 K/V cache (the attention kernels)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def f16_query(q, sm_scale_log2):
    """(q in float16, the softmax scale to use with it). A bfloat16 query can exceed float16's 65504: then
    the tile is divided by the power of two that brings its largest magnitude to at most 2^15 and the scale
    takes the factor back, so the scores are the same. Dividing by a power of two is exact; what float16
    cannot hold is only the low bits of components far below the tile's largest (under 2^-14 of the
    factor), which add nothing the largest ones do not swamp."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(qf), 1), 0)
    unit = tl.math.exp2(tl.maximum(tl.math.ceil(tl.math.log2(amax / 32768.0)), 0.0))
    return (qf / unit).to(tl.float16), sm_scale_log2 * unit
