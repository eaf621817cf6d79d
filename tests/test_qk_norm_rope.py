"""The fused q/k-norm + rotary + K/V store kernel against the unfused torch composition, on fresh random
inputs: every model dtype and head size, a cache of the model's dtype and an FP8 one, with and without
q/k norm (interpreter on CPU, compiled on CUDA)."""
import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (interpreter on CPU)
from llmserve_core.kernels.fp8_format import FP8
from llmserve_core.kernels.qk_norm_rope import qk_norm_rope_store, qk_norm_rope_store_reference
from llmserve_core.layers.rotary import RotaryEmbedding

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# Two ulps of the model dtype: the kernel's float32 sums run in another order than torch's.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 * 2 ** -7, torch.float16: 2 * 2 ** -10}


def run_case(T, hq, hk, d, dtype, cache_dtype, seed, norm=True, k_scale=1.0, v_scale=1.0, block_size=4,
             device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 3).to(dtype).to(device)
    pos = torch.randint(0, 500, (T,), generator=g).to(device)
    qw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(device) if norm else None
    kw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(device) if norm else None
    rot = RotaryEmbedding(d, 512, 10000.0, None, 512, dtype, device)
    num_blocks = -(-T // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[::3] = -1                                   # tokens whose K/V must not be stored
    slots = slots.to(device)
    shape = (num_blocks, block_size, hk, d)
    kc = (torch.randn(shape, generator=g) * 0.1).to(device=device, dtype=cache_dtype)
    vc = (torch.randn(shape, generator=g) * 0.1).to(device=device, dtype=cache_dtype)
    kr, vr = kc.clone(), vc.clone()
    q = qk_norm_rope_store(qkv, pos, slots, qw, kw, rot.cos, rot.sin, 1e-6, hq, hk, d, kc, vc, k_scale, v_scale)
    rq = qk_norm_rope_store_reference(qkv, pos, slots, qw, kw, rot.cos, rot.sin, 1e-6, hq, hk, d, kr, vr,
                                      k_scale, v_scale)
    return q, rq, (kc, vc), (kr, vr), slots


def assert_close_in_dtype(got, ref, tol):
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    if got.dtype != torch.float32:   # not merely close: the same rounding almost everywhere
        assert (got.float() == ref.float()).float().mean() > 0.97


def assert_fp8_close(got, ref, scale):
    """FP8 rows from inputs that may differ by an ulp of the model dtype: the same byte almost everywhere,
    else one e4m3 step (1/8 relative) apart."""
    assert (got.view(torch.uint8) == ref.view(torch.uint8)).float().mean() > 0.97
    torch.testing.assert_close(got.float() * scale, ref.float() * scale, rtol=0.13, atol=scale * 2 ** -9)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_matches_reference(dtype, head_dim):
    q, rq, caches, refs, slots = run_case(7, 4, 2, head_dim, dtype, dtype, seed=head_dim + len(str(dtype)))
    assert q.shape == (7, 4, head_dim) and q.dtype == dtype
    assert_close_in_dtype(q, rq, TOL[dtype])
    for got, ref in zip(caches, refs):
        assert_close_in_dtype(got, ref, TOL[dtype])
    assert (slots < 0).any()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_fp8_cache(dtype, head_dim):
    k_scale, v_scale = 0.005, 0.004     # normed k reaches about 3.5: past 448 * 0.005, so some k saturate
    q, rq, (kc, vc), (kr, vr), _ = run_case(5, 4, 2, head_dim, dtype, FP8, seed=head_dim, k_scale=k_scale,
                                            v_scale=v_scale)
    assert_close_in_dtype(q, rq, TOL[dtype])
    assert_fp8_close(kc, kr, k_scale)
    assert_fp8_close(vc, vr, v_scale)
    assert torch.isfinite(kc.float()).all() and kc.float().abs().max() == 448      # saturated, not NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_without_qk_norm(dtype):
    """An EAGLE-3 draft layer without q/k norm: rotary and the store alone."""
    q, rq, caches, refs, _ = run_case(6, 8, 2, 64, dtype, dtype, seed=3, norm=False)
    assert_close_in_dtype(q, rq, TOL[dtype])
    for got, ref in zip(caches, refs):
        assert_close_in_dtype(got, ref, TOL[dtype])


def test_head_dim_that_is_not_a_power_of_two():
    q, rq, caches, refs, _ = run_case(4, 2, 1, 48, torch.float32, torch.float32, seed=9)
    assert_close_in_dtype(q, rq, 1e-5)
    if CUDA:    # the compiled kernel contracts multiply-adds that torch rounds apart: a few ulps
        assert_close_in_dtype(caches[0], refs[0], 1e-5) and assert_close_in_dtype(caches[1], refs[1], 1e-5)
    else:
        assert torch.equal(caches[0], refs[0]) and torch.equal(caches[1], refs[1])


def test_bad_shapes_are_refused():
    qkv = torch.zeros(2, 6 * 16)
    cache = torch.zeros(3, 4, 2, 16)
    rot = RotaryEmbedding(16, 64, 10000.0, None, 64, torch.float32, "cpu")
    pos, slots = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    with pytest.raises(AssertionError, match="qkv"):
        qk_norm_rope_store(qkv[:, :80], pos, slots, None, None, rot.cos, rot.sin, 1e-6, 2, 2, 16, cache, cache)
    with pytest.raises(AssertionError, match="slot_mapping"):
        qk_norm_rope_store(qkv, pos, slots[:1], None, None, rot.cos, rot.sin, 1e-6, 2, 2, 16, cache, cache)
    with pytest.raises(AssertionError, match="k_cache"):
        qk_norm_rope_store(qkv, pos, slots, None, None, rot.cos, rot.sin, 1e-6, 2, 2, 16, cache[:, :, :1],
                           cache)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64, 777])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_qwen3_8b_heads(T, cache_dtype):
    q, rq, (kc, vc), (kr, vr), _ = run_case(T, 32, 8, 128, torch.bfloat16, cache_dtype, seed=T, block_size=16,
                                            k_scale=0.05, v_scale=0.01)
    assert_close_in_dtype(q, rq, TOL[torch.bfloat16])
    if cache_dtype == FP8:
        assert_fp8_close(kc, kr, 0.05)
        assert_fp8_close(vc, vr, 0.01)
    else:
        assert_close_in_dtype(kc, kr, TOL[torch.bfloat16])
        assert_close_in_dtype(vc, vr, TOL[torch.bfloat16])
