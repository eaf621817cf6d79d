"""Every Triton kernel against its torch reference on fresh random inputs.

Without CUDA the kernels run in Triton's interpreter (llmserve_core.kernels arranges that on import), so
the tiny-shape tests run everywhere; tests marked gpu repeat them at Qwen3-8B shapes in bf16.
"""
from __future__ import annotations

import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels.attention_reference import paged_attention_reference
from llmserve_core.kernels.fp8_format import FP8, MIN_SCALE, RowQuant, to_cache_dtype
from llmserve_core.kernels.fp8_quant import quantize_activation, quantize_activation_reference
from llmserve_core.kernels.paged_decode import DecodeScratch, choose_num_splits, paged_decode
from llmserve_core.kernels.paged_prefill import paged_prefill
from llmserve_core.kernels.rmsnorm import rmsnorm, rmsnorm_quant_reference, rmsnorm_reference
from llmserve_core.kernels.rotary import rotary_reference
from llmserve_core.kernels.silu_mul import silu_mul, silu_mul_reference
from llmserve_core.kernels import tuned
from llmserve_core.kernels.paged_prefill import prefill_tiles
from llmserve_core.kernels.tiling import TileConfig, attention_smem_bytes, decode_config
from llmserve_core.layers.attention.torch_ref import TorchAttentionBackend
from llmserve_core.layers.attention.triton_backend import TritonAttentionBackend
from llmserve_core.layers.batch import ForwardBatch
from helpers.batch import allocate_tables, make_batch
from helpers.kernels import CUDA, DEVICE, paged_cache, prefill_case, rel_err

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


# ---------------------------------------------------------------- decode

@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,block_size,num_splits", [
    ([5, 40, 17], 4, 2, 16, 16, None),
    ([1, 33], 8, 2, 32, 4, 4),
    ([70], 2, 2, 16, 8, 1),
    ([0, 20, 3], 4, 1, 16, 16, 8),          # a zero-length row, as CUDA-graph padding leaves it
    ([100, 64, 7, 50], 6, 2, 16, 32, 2),    # group of 3: padded head rows in the program
    ([9, 30], 4, 2, 24, 8, 2),              # head_dim that is not a power of two
])
def test_paged_decode(seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits):
    gen = torch.Generator().manual_seed(sum(seq_lens) + num_heads)
    kc, vc, bt = paged_cache(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, DEVICE, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, kc, vc, bt, lens, 0.3, out=out, num_splits=num_splits)
    ref = paged_attention_reference(q, kc, vc, lens, bt, 0.3)
    assert rel_err(out, ref) < 1e-5


DTYPE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("kv", ["model", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_decode_dtypes_head_dims_and_fp8(dtype, head_dim, kv):
    """One launch: the long sequence is merged from several pieces, the short ones run in one piece."""
    gen = torch.Generator().manual_seed(head_dim + len(kv))
    seq_lens = [70, 9, 0]
    kc, vc, bt = paged_cache(seq_lens, 16, 2, head_dim, torch.float32, DEVICE, gen)
    k_scale, v_scale = (0.02, 0.005) if kv == "fp8" else (1.0, 1.0)
    if kv == "fp8":
        kc, vc = to_cache_dtype(kc * 3, FP8, k_scale), to_cache_dtype(vc * 0.02, FP8, v_scale)
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(len(seq_lens), 4, head_dim, generator=gen).to(device=DEVICE, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scratch = DecodeScratch()
    out = torch.full_like(q, float("nan"))
    paged_decode(q, kc, vc, bt, lens, head_dim ** -0.5, out=out, num_splits=4, scratch=scratch,
                 k_scale=k_scale, v_scale=v_scale)
    ref = paged_attention_reference(q, kc, vc, lens, bt, head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype and rel_err(out, ref) < DTYPE_TOL[dtype]
    assert not scratch.counts.any(), "the merging piece re-arms its counter"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tree", [False, True])
def test_paged_decode_verify_rows_merge_pieces(dtype, tree):
    """A verify's rows (causal or through a tree mask) split over pieces and merged in the same launch."""
    q, kc, vc, bt, qsl, lens, mask = prefill_case([3] * 3, [60, 2, 30], 4, 2, 64, 8, dtype, DEVICE, seed=5,
                                                  tree=tree)
    scratch = DecodeScratch()
    out = paged_decode(q, kc, vc, bt, lens, 0.3, num_splits=4, scratch=scratch, rows_per_seq=3, tree_mask=mask)
    ref = paged_attention_reference(q, kc, vc, lens, bt, 0.3, query_start_loc=qsl, tree_mask=mask)
    assert rel_err(out, ref) < DTYPE_TOL[dtype]
    assert not scratch.counts.any()


@pytest.mark.parametrize("quant", [RowQuant(16), RowQuant(16, m_major=True, pad_rows=4)])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype,kv", [(torch.float32, "model"), (torch.bfloat16, "model"), (torch.bfloat16, "fp8")])
def test_paged_decode_hands_o_proj_its_rows_quantized_per_head(quant, num_splits, dtype, kv):
    """A decode asked for quantized rows (a scale per head, as a block-scaled o_proj's GEMM reads them)
    returns exactly what quantize_activation makes of its plain output, in quant's layout (the padding rows
    zeros at the floor scale), whether one piece or the merge of several writes each row; an empty
    sequence (graph padding) gives zero codes."""
    gen = torch.Generator().manual_seed(num_splits)
    seq_lens = [70, 9, 0, 33, 1]
    kc, vc, bt = paged_cache(seq_lens, 8, 2, 16, torch.float32, DEVICE, gen)
    vc[:, :, 1] *= 40                           # KV head 1's heads (2, 3) far louder than the others'
    scales_kv = dict(k_scale=0.02, v_scale=0.3) if kv == "fp8" else {}
    if kv == "fp8":
        kc, vc = to_cache_dtype(kc, FP8, 0.02), to_cache_dtype(vc, FP8, 0.3)
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(len(seq_lens), 4, 16, generator=gen).to(device=DEVICE, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    plain = paged_decode(q, kc, vc, bt, lens, 0.3, num_splits=num_splits, **scales_kv)
    codes, scales = paged_decode(q, kc, vc, bt, lens, 0.3, num_splits=num_splits, quant=quant, **scales_kv)
    want_codes, want_scales = quantize_activation(plain.reshape(len(seq_lens), 64), quant.group, quant.m_major,
                                                  quant.pad_rows)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales) and scales.stride() == want_scales.stride()
    assert scales[1, 2] > 10 * scales[1, 1] and not codes[2].float().any()
    if quant.pad_rows > 1:
        assert codes.shape[0] == 8 and not codes[5:].float().any() and torch.all(scales[5:] == MIN_SCALE)
    with pytest.raises(AssertionError, match="one scale a head"):
        paged_decode(q, kc, vc, bt, lens, 0.3, quant=RowQuant(32))


def test_paged_decode_piece_length_only_changes_the_schedule():
    """The same attention from 8 pieces, from pieces of at least 48 keys, and from one piece; a second
    launch over the same scratch (as a replayed graph) finds the counters re-armed."""
    gen = torch.Generator().manual_seed(2)
    seq_lens = [130, 47, 1]
    kc, vc, bt = paged_cache(seq_lens, 8, 2, 16, torch.float32, DEVICE, gen)
    q = torch.randn(3, 4, 16, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_reference(q, kc, vc, lens, bt, 0.3)
    scratch = DecodeScratch()
    for min_split in (None, 48, 1000, None):
        out = paged_decode(q, kc, vc, bt, lens, 0.3, num_splits=8, scratch=scratch, min_split=min_split)
        assert rel_err(out, ref) < 1e-5, min_split
        assert not scratch.counts.any()


def test_num_splits_fill_the_gpu():
    assert choose_num_splits(1, 8) == 32 and choose_num_splits(4, 8) == 32 and choose_num_splits(16, 8) == 8
    assert choose_num_splits(64, 8) == 1 and choose_num_splits(256, 8) == 1
    for b in range(1, 300):
        s = choose_num_splits(b, 8)
        if b * 8 >= 2 * 132:
            assert s == 1
        else:
            assert s & (s - 1) == 0 and (s == 32 or b * 8 * s >= 4 * 132)


# ---------------------------------------------------------------- prefill / extend

@pytest.mark.parametrize("query_lens,ctx_lens,num_heads,num_kv_heads,head_dim,block_size", [
    ([5, 20, 1], [0, 0, 0], 4, 2, 16, 16),          # plain prefill
    ([5, 33, 3], [7, 40, 0], 4, 2, 16, 4),          # extend over a cached prefix
    ([17, 1, 1], [3, 50, 9], 8, 2, 32, 8),          # chunked prefill mixed with decode rows
    ([40], [0], 3, 1, 16, 32),                      # MQA, tiles wider than a block
    ([0, 9], [5, 18], 4, 4, 16, 16),                # a sequence without new tokens
    ([6, 11], [4, 0], 4, 2, 24, 8),                 # head_dim that is not a power of two
])
def test_paged_prefill(query_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size):
    q, kc, vc, bt, qsl, lens, _ = prefill_case(query_lens, ctx_lens, num_heads, num_kv_heads, head_dim,
                                               block_size, torch.float32, DEVICE, sum(query_lens) + head_dim)
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, kc, vc, qsl, lens, bt, max(query_lens), 0.25, out=out)
    ref = paged_attention_reference(q, kc, vc, lens, bt, 0.25, query_start_loc=qsl)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("query_lens,ctx_lens,block_size", [([4, 7], [9, 30], 16), ([6, 5, 1], [0, 13, 2], 4)])
def test_paged_prefill_tree_mask(query_lens, ctx_lens, block_size):
    q, kc, vc, bt, qsl, lens, tree = prefill_case(query_lens, ctx_lens, 4, 2, 16, block_size, torch.float32,
                                                  DEVICE, 7 + block_size, tree=True)
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, kc, vc, qsl, lens, bt, max(query_lens), 0.25, tree_mask=tree, out=out)
    ref = paged_attention_reference(q, kc, vc, lens, bt, 0.25, query_start_loc=qsl, tree_mask=tree)
    assert rel_err(out, ref) < 1e-5
    causal = paged_attention_reference(q, kc, vc, lens, bt, 0.25, query_start_loc=qsl)
    assert rel_err(out, causal) > 1e-3, "the tree mask must change the result"


# ---------------------------------------------------------------- small fused ops

@pytest.mark.parametrize("rows,cols,with_residual", [(5, 48, False), (3, 100, True), (1, 16, True)])
def test_rmsnorm(rows, cols, with_residual):
    from llmserve_core.layers.norm import RMSNorm
    gen = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=gen).to(DEVICE)
    w = torch.randn(cols, generator=gen).to(DEVICE)
    res = torch.randn(rows, cols, generator=gen).to(DEVICE) if with_residual else None
    x_before = x.clone()
    got = rmsnorm(x, w, 1e-6, res)
    ref = rmsnorm_reference(x, w, 1e-6, res)
    layer = RMSNorm(cols, eps=1e-6, device=DEVICE)
    layer.weight.data.copy_(w)
    eager = layer(x, res) if res is not None else layer(x)
    assert torch.equal(x, x_before), "inputs must not be modified"
    for a, b, c in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, ref, eager))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def check_quantized_rows(q, scale, quant, rows, width, q_ref, scale_ref, scale_rtol, code_mismatch):
    """e4m3 rows and scales in quant's layout (padding rows: zero codes at the floor scale) against the
    unpadded, row-major (q_ref, scale_ref)."""
    padded = -(-rows // quant.pad_rows) * quant.pad_rows
    groups = -(-width // quant.group)
    assert q.dtype == FP8 and q.shape == (padded, width) and scale.shape == (padded, groups)
    if quant.m_major:
        assert scale.stride() == (1, padded)
    torch.testing.assert_close(scale[:rows], scale_ref, rtol=scale_rtol, atol=0)
    mismatched = (q[:rows].view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item()
    assert mismatched <= code_mismatch
    assert not q[rows:].float().any() and torch.all(scale[rows:] == MIN_SCALE)


ROW_QUANTS = [  # (rows, width, quant): per 1 x group piece, one scale per row (a width no power of 2 too),
    (3, 256, RowQuant(128)), (1, 96, RowQuant(32)), (3, 256, RowQuant(256)), (2, 96, RowQuant(96)),
    (5, 256, RowQuant(128, m_major=True, pad_rows=4)), (4, 256, RowQuant(128, m_major=True, pad_rows=4))]
# ... and M-major scales over rows padded to a multiple of 4 (cuBLAS's block scaling), with and without padding


@pytest.mark.parametrize("rows,cols,quant", ROW_QUANTS)
@pytest.mark.parametrize("with_residual,dtype", [(True, torch.float32), (False, torch.float16)])
def test_rmsnorm_quantized_output_is_fp8_quant_of_the_norm(rows, cols, quant, with_residual, dtype):
    """The e4m3 rows and per-piece (or per-row) scales equal fp8_quant's arithmetic on the norm's output
    (what the FP8 GEMV or GEMM after it would compute from it) in the layout the quant names, and the
    residual stream is unchanged; a piece of zeros keeps zeros."""
    gen = torch.Generator().manual_seed(rows * cols + quant.group)
    x = (torch.randn(rows, cols, generator=gen) * 3).to(DEVICE, dtype)
    if quant.group < cols:
        x[0, :quant.group] = 0.0                        # a piece of zeros: the floor scale, zero codes
    w = torch.randn(cols, generator=gen).to(DEVICE, dtype)
    res = torch.zeros(rows, cols, dtype=dtype).to(DEVICE) if with_residual else None
    got = rmsnorm(x, w, 1e-6, res, quant=quant)
    ref = rmsnorm_quant_reference(x, w, 1e-6, res, quant.group)
    (q, scale), (q_ref, scale_ref) = (got[0], ref[0]) if with_residual else (got, ref)
    # The quantization of the kernel's own normed row: on a GPU that row may differ from the reference norm's
    # by an ulp of float16 (its square root and division), which the quantization must not add to.
    own = rmsnorm(x, w, 1e-6, res)
    q_own, scale_own = quantize_activation_reference(own[0] if with_residual else own, quant.group)
    check_quantized_rows(q, scale, quant, rows, cols, q_own, scale_own, 1e-6, 1e-3 if DEVICE == "cpu" else 2e-2)
    torch.testing.assert_close(scale[:rows], scale_ref, rtol=1e-6 if DEVICE == "cpu" else 2e-3, atol=0)
    if quant.group < cols:
        assert torch.equal(q[0, :quant.group].float(), torch.zeros(quant.group, device=q.device))
    if with_residual:
        assert torch.equal(got[1], ref[1])
    with pytest.raises(AssertionError, match="power of 2 dividing"):
        rmsnorm(x, w, 1e-6, quant=RowQuant(48))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (3, 3, 8)])
def test_rotary_reference_matches_the_eager_layer(num_heads, num_kv_heads, head_dim):
    """The float32 rotation the fused q/k kernel is checked against is the model's own rotary."""
    from llmserve_core.layers.rotary import RotaryEmbedding
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None, 64, torch.float32, DEVICE)
    t = 7
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    positions = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    q_ref, k_ref = rotary_reference(q, k, positions, rope.cos, rope.sin)
    cos, sin = rope.cos_sin(positions)
    torch.testing.assert_close(q_ref, rope.apply(q, cos, sin), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ref, rope.apply(k, cos, sin), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(q_ref[positions > 0], q[positions > 0])


@pytest.mark.parametrize("rows,d", [(3, 40), (2, 2048 + 3)])
def test_silu_mul(rows, d):
    from llmserve_core.layers.activation import silu_and_mul
    x = torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(d)).to(DEVICE)
    out = silu_mul(x)
    torch.testing.assert_close(out, silu_mul_reference(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, silu_and_mul(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,d,quant,dtype", [
    (3, 256, RowQuant(128), torch.float32), (2, 2048 + 1024, RowQuant(128), torch.float16),
    (1, 96, RowQuant(32), torch.float32), (5, 256, RowQuant(128, m_major=True, pad_rows=4), torch.float32),
    (3, 2048 + 1024, RowQuant(2048 + 1024), torch.float16), (2, 96, RowQuant(96), torch.float32),
    (2, 17000, RowQuant(17000), torch.float32)]       # one scale per row, wider than the row kernel's tile
    + ([(5, 12288, RowQuant(128), torch.bfloat16), (65, 12288, RowQuant(12288), torch.bfloat16),
        (65, 12288, RowQuant(128, m_major=True, pad_rows=4), torch.bfloat16)] if CUDA else []))
def test_silu_mul_quantized_output_is_fp8_quant_of_its_row(rows, d, quant, dtype):
    """The e4m3 rows and per-piece (or per-row) scales equal fp8_quant's arithmetic on the kernel's own
    output row in the model dtype (what the FP8 GEMV or GEMM would compute from it), in the quant's layout,
    across program boundaries (d past one 1024-wide program) and, for one scale per row, across the
    row-long loop's tiles; a piece of zeros keeps zero codes at the floor scale."""
    gen = torch.Generator().manual_seed(rows * d + quant.group)
    x = (torch.randn(rows, 2 * d, generator=gen) * 3).to(DEVICE, dtype)
    if quant.group < d:
        x[0, :quant.group] = 0.0                        # gate zero: a piece of zeros
    x[1 % rows, d - 1] = 40.0        # one large product in the last tile: the row's scale comes from there
    q, scale = silu_mul(x, quant=quant)
    q_ref, scale_ref = quantize_activation_reference(silu_mul(x), quant.group)
    # exact in the interpreter; a GPU's float32 division may land an ulp away, moving a rare code by one step
    check_quantized_rows(q, scale, quant, rows, d, q_ref, scale_ref, 0 if DEVICE == "cpu" else 1e-6,
                         0 if DEVICE == "cpu" else 1e-3)
    if quant.group < d:
        assert torch.equal(q[0, :quant.group].float(), torch.zeros(quant.group, device=q.device))
    with pytest.raises(AssertionError, match="quantization groups"):
        silu_mul(x, quant=RowQuant(48))


# ---------------------------------------------------------------- backend end to end

def backend_steps(steps, block_size, num_heads, num_kv_heads, head_dim, dtype, device, seed, backends):
    """Run the same prefill / extend / decode steps through each backend; return outputs and caches."""
    gen = torch.Generator().manual_seed(seed)
    final = [sum(new for _, new in seq_steps) for seq_steps in zip(*steps)]
    tables, num_blocks = allocate_tables(final, block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in backends]
    outs = [[] for _ in backends]
    for step in steps:
        batch = make_batch(step, tables, block_size, device=device)
        t = batch.num_tokens
        q = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
        k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
        v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
        for i, backend in enumerate(backends):
            outs[i].append(backend.forward(q, k, v, *caches[i], batch, head_dim ** -0.5))
    return outs, caches


STEPS = [
    [(0, 9), (0, 20), (0, 3)],      # prefill
    [(9, 4), (20, 1), (3, 12)],     # chunked prefill mixed with a decode row
    [(13, 1), (21, 1), (15, 1)],    # decode
    [(14, 1), (22, 1), (16, 1)],    # decode
]


@pytest.mark.parametrize("block_size", [4, 16])
def test_triton_backend_matches_torch(block_size):
    outs, caches = backend_steps(STEPS, block_size, 4, 2, 16, torch.float32, DEVICE, block_size,
                                 [TorchAttentionBackend(), TritonAttentionBackend()])
    for ref, got in zip(*outs):
        assert rel_err(got, ref) < 1e-5
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_triton_backend_tree_verify():
    q, kc, vc, bt, qsl, lens, tree = prefill_case([4, 3], [6, 11], 4, 2, 16, 4, torch.float32, DEVICE, 3,
                                                  tree=True)
    batch = ForwardBatch(positions=torch.zeros(7, dtype=torch.int64, device=DEVICE),
                         slot_mapping=torch.full((7,), -1, dtype=torch.int64, device=DEVICE),
                         query_start_loc=qsl, seq_lens=lens, block_tables=bt, max_query_len=4, max_seq_len=14,
                         tree_mask=tree)
    k = torch.randn(7, 2, 16, device=DEVICE)
    got = TritonAttentionBackend().forward(q, k, k, kc.clone(), vc.clone(), batch, 0.25)
    ref = TorchAttentionBackend().forward(q, k, k, kc.clone(), vc.clone(), batch, 0.25)
    assert rel_err(got, ref) < 1e-5


def test_flash_attn_backend_names_what_is_missing():
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash_attn is installed here")
    except ImportError:
        pass
    from llmserve_core.layers.attention.flash_attn_backend import FlashAttentionBackend
    with pytest.raises(ImportError, match="flash-attn-4.*triton"):
        FlashAttentionBackend()


# ---------------------------------------------------------------- GPU, Qwen3-8B shapes, bf16

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch,ctx", [(1, 4096), (1, 8191), (8, 1000), (64, 513), (256, 300)])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (32, 4)])
def test_gpu_paged_decode(batch, ctx, block_size, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(batch + ctx + block_size)
    seq_lens = (torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen)).tolist()
    seq_lens[0] = ctx
    kc, vc, bt = paged_cache(seq_lens, block_size, num_kv_heads, 128, torch.bfloat16, "cuda", gen)
    q = torch.randn(batch, num_heads, 128, generator=gen).to(dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    paged_decode(q, kc, vc, bt, lens, 128 ** -0.5, out=out)
    assert rel_err(out, paged_attention_reference(q, kc, vc, lens, bt, 128 ** -0.5)) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [37, 128])
def test_gpu_paged_decode_quantized_rows_at_qwen3_8b_shapes(batch):
    """The decode's rows quantized a scale per head, in the layouts o_proj's GEMMs read (cuBLAS's M-major
    scales over rows padded to 4, the Triton GEMM's row-major ones), are bit for bit quantize_activation's
    of its plain output."""
    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, 700, (batch,), generator=gen).tolist()
    kc, vc, bt = paged_cache(seq_lens, 16, 8, 128, torch.bfloat16, "cuda", gen)
    q = torch.randn(batch, 32, 128, generator=gen).to(dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    plain = paged_decode(q, kc, vc, bt, lens, 128 ** -0.5).reshape(batch, 4096)
    for quant in (RowQuant(128, m_major=True, pad_rows=4), RowQuant(128)):
        codes, scales = paged_decode(q, kc, vc, bt, lens, 128 ** -0.5, quant=quant, pdl=True)
        want_codes, want_scales = quantize_activation(plain, 128, quant.m_major, quant.pad_rows)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), quant
        assert torch.equal(scales, want_scales) and scales.stride() == want_scales.stride(), quant


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("query_lens,ctx_lens", [([512] * 8, [0] * 8), ([1024] * 4, [2048] * 4),
                                                 ([300, 1, 77, 1000], [0, 900, 4000, 37])])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_paged_prefill(query_lens, ctx_lens, block_size):
    q, kc, vc, bt, qsl, lens, _ = prefill_case(query_lens, ctx_lens, 32, 8, 128, block_size, torch.bfloat16,
                                               "cuda", block_size)
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, kc, vc, qsl, lens, bt, max(query_lens), 128 ** -0.5, out=out)
    assert rel_err(out, paged_attention_reference(q, kc, vc, lens, bt, 128 ** -0.5, query_start_loc=qsl)) < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_paged_prefill_tree_mask():
    q, kc, vc, bt, qsl, lens, tree = prefill_case([16, 25, 60], [500, 3000, 7], 32, 8, 128, 16, torch.bfloat16,
                                                  "cuda", 1, tree=True)
    out = paged_prefill(q, kc, vc, qsl, lens, bt, 60, 128 ** -0.5, tree_mask=tree)
    ref = paged_attention_reference(q, kc, vc, lens, bt, 128 ** -0.5, query_start_loc=qsl, tree_mask=tree)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_small_ops_bf16():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen).to(dtype=torch.bfloat16, device="cuda")
    r = torch.randn(64, 4096, generator=gen).to(dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, generator=gen).to(dtype=torch.bfloat16, device="cuda")
    for a, b in zip(rmsnorm(x, w, 1e-6, r), rmsnorm_reference(x, w, 1e-6, r)):
        assert rel_err(a, b) < 1e-2
    (q, scale), stream = rmsnorm(x[:1], w, 1e-6, r[:1], quant=RowQuant(128))
    (q_ref, scale_ref), stream_ref = rmsnorm_quant_reference(x[:1], w, 1e-6, r[:1], 128)
    assert torch.equal(stream, stream_ref) and rel_err(scale, scale_ref) < 1e-2
    assert rel_err(q.float() * scale.repeat_interleave(128, 1), q_ref.float() * scale_ref.repeat_interleave(128, 1)) < 2e-2
    g = torch.randn(64, 2 * 12288, generator=gen).to(dtype=torch.bfloat16, device="cuda")
    assert rel_err(silu_mul(g), silu_mul_reference(g)) < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_triton_backend_bf16_and_decode_graph():
    steps = [[(0, 700), (0, 33)], [(700, 1), (33, 1)], [(701, 1), (34, 1)]]
    outs, _ = backend_steps(steps, 16, 32, 8, 128, torch.bfloat16, "cuda", 0,
                            [TorchAttentionBackend(), TritonAttentionBackend()])
    for ref, got in zip(*outs):
        assert rel_err(got, ref) < 1e-2

    # A captured decode replays correctly after the lengths and tables change on the device.
    backend = TritonAttentionBackend()
    gen = torch.Generator().manual_seed(1)
    kc, vc, bt = paged_cache([3000, 3000, 3000, 3000], 16, 8, 128, torch.bfloat16, "cuda", gen)
    q = torch.randn(4, 32, 128, generator=gen).to(dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([100, 200, 300, 400], dtype=torch.int32, device="cuda")
    batch = ForwardBatch(positions=(lens - 1).long(), slot_mapping=torch.full((4,), -1, dtype=torch.int64,
                         device="cuda"), query_start_loc=torch.arange(5, dtype=torch.int32, device="cuda"),
                         seq_lens=lens, block_tables=bt, max_query_len=1, max_seq_len=3000)
    backend.attend(q, kc, vc, batch, 128 ** -0.5)   # warm up: compile, size the scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(q, kc, vc, batch, 128 ** -0.5)
    for new_lens in ([2999, 1, 1500, 64], [3000, 2048, 17, 2500]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn(4, 32, 128, generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, paged_attention_reference(q, kc, vc, lens, bt, 128 ** -0.5)) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_flash_attn_backend_matches_torch(block_size):
    from llmserve_core.layers.attention.flash_attn_backend import FlashAttentionBackend
    try:
        flash = FlashAttentionBackend()
    except ImportError as e:
        pytest.skip(str(e))
    steps = [[(0, 300), (0, 40)], [(300, 1), (40, 1)], [(301, 64), (41, 1)]]
    outs, caches = backend_steps(steps, block_size, 32, 8, 128, torch.bfloat16, "cuda", 2,
                                 [TorchAttentionBackend(), flash])
    for ref, got in zip(*outs):
        assert rel_err(got, ref) < 1e-2
    assert torch.equal(caches[0][0], caches[1][0])


# ---------------------------------------------------------------- tile configs from the shared memory

H200_SMEM = 232448
ELEMENTS = {2: torch.bfloat16, 4: torch.float32}


def card_with(smem: int, name: str = "Untuned_Card") -> tuned.Device:
    return tuned.Device(name, sms=132, smem=smem, capability=(9, 0))


def test_float32_head_128_prefill_no_longer_asks_for_more_than_the_h200_has():
    h200 = card_with(H200_SMEM, "NVIDIA_H200")
    bf16 = prefill_tiles(h200, 128, torch.bfloat16, short=False)
    assert bf16 == TileConfig(128, 128, 8, 2)                       # the measured best stays
    # The config the H200 refused: 2 stages of 128 x 128 float32 K and V tiles are 262,144 bytes alone.
    assert attention_smem_bytes(TileConfig(128, 128, 8, 2), 128, 4) >= 262144
    fp32 = prefill_tiles(h200, 128, torch.float32, short=False)
    assert fp32 != bf16 and attention_smem_bytes(fp32, 128, 4) <= H200_SMEM
    for block_d in (64, 128, 256):
        for elem in (2, 4):
            for short in (True, False):
                for card in (h200, card_with(H200_SMEM)):
                    cfg = prefill_tiles(card, block_d, ELEMENTS[elem], short)
                    assert attention_smem_bytes(cfg, block_d, elem) <= H200_SMEM
            cfg = decode_config(16, 64, block_d, elem, H200_SMEM)
            assert attention_smem_bytes(cfg, block_d, elem) <= H200_SMEM


def test_configs_fall_back_to_fewer_stages_then_narrower_tiles():
    cfg = decode_config(16, 64, 256, 4, H200_SMEM)                  # float32, head_dim 256
    assert (cfg.block_n, cfg.num_stages) == (64, 1)
    small = 20_000
    cfg = prefill_tiles(card_with(small), 64, torch.float32, short=True)
    assert attention_smem_bytes(cfg, 64, 4) <= small and cfg.num_stages == 1 and cfg.block_n < 32
    with pytest.raises(ValueError, match="does not fit"):
        prefill_tiles(card_with(1024), 256, torch.float32, short=True)


def test_prefill_is_exact_with_a_config_chosen_under_a_tiny_smem_limit():
    """The tiles a small limit picks still compute the same attention (run here in the interpreter)."""
    cfg = prefill_tiles(card_with(9_000), 16, torch.float32, short=True)
    assert cfg.block_n == 16 and cfg.block_m >= 16
    q, kc, vc, bt, qsl, lens, _ = prefill_case([19, 3], [5, 30], 4, 2, 16, 8, torch.float32, DEVICE, 3)
    out = paged_prefill(q, kc, vc, qsl, lens, bt, 19, 0.25, block_m=cfg.block_m, block_n=cfg.block_n)
    assert rel_err(out, paged_attention_reference(q, kc, vc, lens, bt, 0.25, query_start_loc=qsl)) < 1e-5


# ---------------------------------------------------------------- Triton decode + FA4 prefill

def test_fa4_predicate_takes_prefill_and_extend_only():
    from llmserve_core.layers.attention.triton_fa4_backend import FA4_MIN_QUERY_LEN, use_fa4
    tables, _ = allocate_tables([64, 64], 16)
    prefill = make_batch([(0, 40), (10, FA4_MIN_QUERY_LEN)], tables, 16)
    decode = make_batch([(30, 1), (12, 1)], tables, 16)
    short = make_batch([(30, 4), (12, 4)], tables, 16)
    verify = make_batch([(30, 16), (12, 16)], tables, 16)
    verify.uniform_query_len = 16
    assert use_fa4(torch.bfloat16, 128, prefill, capturing=False)
    assert use_fa4(torch.float16, 64, prefill, capturing=False)
    assert not use_fa4(torch.float32, 128, prefill, capturing=False)          # FA4 builds no float32
    assert not use_fa4(torch.bfloat16, 256, prefill, capturing=False)         # nor heads over 128
    assert not use_fa4(torch.bfloat16, 100, prefill, capturing=False)         # nor ones not a multiple of 8
    assert not use_fa4(torch.bfloat16, 128, prefill, capturing=True)          # graphs keep the Triton path
    assert not use_fa4(torch.bfloat16, 128, decode, capturing=False)          # decode: split-KV Triton wins
    assert not use_fa4(torch.bfloat16, 128, short, capturing=False)           # a few rows: mostly padding
    assert not use_fa4(torch.bfloat16, 128, verify, capturing=False)          # verify: Triton's decode rows
    prefill.tree_mask = torch.ones(prefill.num_tokens, 40, dtype=torch.bool)
    assert not use_fa4(torch.bfloat16, 128, prefill, capturing=False)         # tree masks need Triton


def test_triton_fa4_backend_routes_by_the_predicate():
    """Without FA4 here, both sides are stand-ins that record who ran; the GPU test checks the numbers."""
    from llmserve_core.layers.attention.triton_fa4_backend import TritonFA4Backend
    calls = []
    backend = object.__new__(TritonFA4Backend)
    backend.fa4 = lambda q, *a, **kw: (calls.append(("fa4", kw["max_seqlen_q"])), torch.zeros_like(q))[1]
    backend.triton = type("T", (), {"attend": lambda self, q, *a: (calls.append(("triton", a[2].max_query_len)),
                                                                   torch.zeros_like(q))[1]})()
    tables, num_blocks = allocate_tables([80], 16)
    cache = torch.zeros(num_blocks, 16, 2, 16, dtype=torch.float16)
    for step in ([(0, 40)], [(40, 1)], [(41, 4)]):
        batch = make_batch(step, tables, 16)
        t = batch.num_tokens
        q, kv = torch.randn(t, 4, 16).half(), torch.randn(t, 2, 16).half()
        backend.forward(q, kv, kv, cache, cache.clone(), batch, 0.25)
    assert calls == [("fa4", 40), ("triton", 1), ("triton", 4)]
    assert cache.abs().sum() > 0, "forward stores this step's K/V before either side attends"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_triton_fa4_backend_matches_torch(block_size, dtype):
    """Prefill, chunked extend mixed with decode rows, decode and a short verify-like extend, against the
    torch reference: pages of 16 (FA4's non-TMA path) and 128 (its TMA path)."""
    from llmserve_core.layers.attention.triton_fa4_backend import TritonFA4Backend
    try:
        backend = TritonFA4Backend()
    except ImportError as e:
        pytest.skip(str(e))
    steps = [[(0, 300), (0, 40), (0, 700)], [(300, 1), (40, 1), (700, 129)], [(301, 64), (41, 1), (829, 1)],
             [(365, 4), (42, 4), (830, 4)]]
    outs, caches = backend_steps(steps, block_size, 32, 8, 128, dtype, "cuda", 5, [TorchAttentionBackend(), backend])
    for ref, got in zip(*outs):
        assert rel_err(got, ref) < 1e-2
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_kernels_bench_smoke(tmp_path):
    """benchmarks/kernels_bench.py end to end on tiny shapes under the interpreter (the H200 runs the real
    ones), so the benchmark cannot rot unseen: every timed kernel checked against its reference."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_bench.py"
    subprocess.run([sys.executable, str(script), str(tmp_path), "--smoke"], check=True, timeout=900,
                   capture_output=True)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    kinds = {r["kind"] for r in rows}
    assert {"decode", "verify", "prefill", "extend", "decode_after_gemm"} <= kinds, kinds
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    assert all(r["rel_err"] < 1e-3 for r in rows if "rel_err" in r and r["impl"] != "torch eager")
    assert "| verify B x rows |" in (tmp_path / "results.md").read_text()
