"""One K/V tile into a flash-attention loop's online softmax: the step the paged decode and prefill kernels
share. A @triton.jit function called from a kernel is inlined into it, so sharing it costs no call."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, k, v, n, n_mask, rows, row_mask, prefix, limit, tree_ptr, stride_tree, sm_scale_log2,
                m_i, l_i, acc, CAUSAL: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
                MASKED: tl.constexpr):
    """One K/V tile (keys n) into the online softmax of the tile's query rows: (m_i, l_i, acc) after it.

    MASKED False: every row sees every key of the tile (the loop's interior), and the rest of the masking
    arguments are not read. Otherwise a row sees the keys n_mask holds and, with HAS_TREE, of those from
    `prefix` on only what its tree-mask row allows (row rows[i] of tree_ptr, its ancestors), or with CAUSAL
    only those before its `limit`."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
    if MASKED:
        if HAS_TREE:
            own = (n[None, :] >= prefix) & n_mask[None, :] & row_mask[:, None]
            bit = tl.load(tree_ptr + rows[:, None] * stride_tree + (n[None, :] - prefix), mask=own, other=0)
            visible = n_mask[None, :] & ((n[None, :] < prefix) | (bit != 0))
        elif CAUSAL:
            visible = n_mask[None, :] & (n[None, :] < limit[:, None])
        else:
            visible = n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that sees nothing in this tile yet keeps m at -inf: shift by 0 there instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
