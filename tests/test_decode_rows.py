"""The decode kernel over several query rows per sequence (verify, padded catch-up), causal or with a tree
mask, against the one torch paged-attention reference (a verify is an extend of R rows)."""
from __future__ import annotations

import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels.attention_reference import paged_attention_reference
from llmserve_core.kernels.paged_decode import paged_decode
from helpers.kernels import prefill_case, rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("rows,ctx_lens,num_heads,num_kv_heads,head_dim,block_size,tree", [
    (4, [7, 40, 0], 4, 2, 16, 4, False),       # chain verify: last token + 3 drafts
    (1, [5, 18, 3], 4, 4, 16, 16, False),      # a plain decode through the same path
    (3, [9, 30], 8, 2, 32, 8, True),           # tree verify
    (5, [0, 12, 70], 3, 1, 16, 16, True),      # MQA, a sequence with nothing cached
    (2, [33], 4, 2, 24, 8, False),             # head_dim that is not a power of two
])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_rows_match_reference(rows, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, tree,
                                     num_splits):
    query_lens = [rows] * len(ctx_lens)
    q, kc, vc, bt, qsl, lens, mask = prefill_case(query_lens, ctx_lens, num_heads, num_kv_heads, head_dim,
                                                  block_size, torch.float32, DEVICE, seed=rows * 10 + num_splits,
                                                  tree=tree)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, kc, vc, bt, lens, 0.3, out=out, num_splits=num_splits, rows_per_seq=rows, tree_mask=mask)
    ref = paged_attention_reference(q, kc, vc, lens, bt, 0.3, query_start_loc=qsl, tree_mask=mask)
    assert rel_err(out, ref) < 1e-5


def test_decode_rows_refuses_ragged_rows():
    q, kc, vc, bt, qsl, lens, _ = prefill_case([3, 3], [4, 4], 4, 2, 16, 4, torch.float32, DEVICE, seed=1)
    with pytest.raises(AssertionError, match="per sequence"):
        paged_decode(q[:5], kc, vc, bt, lens, 0.3, rows_per_seq=3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows,tree", [(4, False), (8, True), (1, False)])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_decode_rows_qwen3_8b_bf16(rows, tree, batch):
    ctx = [500 + 37 * i for i in range(batch)]
    q, kc, vc, bt, qsl, lens, mask = prefill_case([rows] * batch, ctx, 32, 8, 128, 16, torch.bfloat16, "cuda",
                                                  seed=batch + rows, tree=tree)
    out = paged_decode(q, kc, vc, bt, lens, 128 ** -0.5, rows_per_seq=rows, tree_mask=mask)
    ref = paged_attention_reference(q, kc, vc, lens, bt, 128 ** -0.5, query_start_loc=qsl, tree_mask=mask)
    assert rel_err(out, ref) < 1e-2
