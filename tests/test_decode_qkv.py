"""The decode from packed qkv rows (q/k norm, rotary and this step's K/V store inside the decode kernel)
against the two-kernel composition's torch references: qk_norm_rope_store_reference, then the one torch
paged-attention reference over the stored caches. Interpreter on the CPU, compiled on CUDA."""
from __future__ import annotations

import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels.attention_reference import paged_attention_reference
from llmserve_core.kernels.fp8_format import FP8, to_cache_dtype
from llmserve_core.kernels.paged_decode import paged_decode_qkv
from llmserve_core.kernels.qk_norm_rope import qk_norm_rope_store_reference
from llmserve_core.layers.rotary import RotaryEmbedding
from test_kernels import paged_cache, rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-6


def qkv_case(ctx_lens, hq, hk, d, block_size, dtype, device, seed, norm=True, fp8_cache=None, padding=0):
    """B sequences each decoding one token after ctx_lens[b] cached ones, and `padding` graph-padding rows
    (length 1, slot -1) after them. The caches also hold stale values at the new positions."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + 1 for c in ctx_lens] + [1] * padding
    kc, vc, bt = paged_cache(seq_lens, block_size, hk, d, dtype, device, gen)
    if fp8_cache is not None:
        kc, vc = to_cache_dtype(kc * 3, FP8, fp8_cache[0]), to_cache_dtype(vc * 0.2, FP8, fp8_cache[1])
    qkv = (torch.randn(len(seq_lens), (hq + 2 * hk) * d, generator=gen) * 3).to(dtype=dtype, device=device)
    pos = torch.tensor([s - 1 for s in seq_lens], device=device)
    slots = torch.stack([bt[b, (s - 1) // block_size].long() * block_size + (s - 1) % block_size
                         for b, s in enumerate(seq_lens)])
    slots[len(ctx_lens):] = -1
    qw = (torch.rand(d, generator=gen) + 0.5).to(dtype=dtype, device=device) if norm else None
    kw = (torch.rand(d, generator=gen) + 0.5).to(dtype=dtype, device=device) if norm else None
    rot = RotaryEmbedding(d, 4096, 10000.0, None, 4096, dtype, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return qkv, pos, slots, qw, kw, rot, kc, vc, bt, lens


def run(ctx_lens, hq, hk, d, block_size, dtype, seed, num_splits=None, norm=True, fp8_cache=None, padding=0,
        device=DEVICE, pdl=False):
    qkv, pos, slots, qw, kw, rot, kc, vc, bt, lens = qkv_case(ctx_lens, hq, hk, d, block_size, dtype, device, seed,
                                                              norm, fp8_cache, padding)
    k_scale, v_scale = fp8_cache or (1.0, 1.0)
    kr, vr = kc.clone(), vc.clone()
    q = qk_norm_rope_store_reference(qkv, pos, slots, qw, kw, rot.cos, rot.sin, EPS, hq, hk, d, kr, vr,
                                     k_scale, v_scale)
    ref = paged_attention_reference(q, kr, vr, lens, bt, d ** -0.5, k_scale=k_scale, v_scale=v_scale)
    out = paged_decode_qkv(qkv, pos, slots, qw, kw, rot.cos, rot.sin, EPS, hq, kc, vc, bt, lens, d ** -0.5,
                           k_scale=k_scale, v_scale=v_scale, num_splits=num_splits, pdl=pdl)
    return out, ref, (kc, vc), (kr, vr), len(ctx_lens)


@pytest.mark.parametrize("ctx_lens,hq,hk,d,block_size,num_splits", [
    ([4, 39, 16], 4, 2, 16, 16, None),       # one piece a sequence
    ([0, 32, 70], 8, 2, 32, 4, 4),           # split: the new position in a piece's first or a later tile
    ([100, 63, 64, 7], 6, 2, 16, 8, 3),      # group of 3; the new key at a tile's first and last column
    ([20], 4, 4, 64, 16, 1),
])
@pytest.mark.parametrize("norm", [True, False])
def test_decode_qkv_matches_the_two_kernel_composition(ctx_lens, hq, hk, d, block_size, num_splits, norm):
    out, ref, caches, refs, n = run(ctx_lens, hq, hk, d, block_size, torch.float32, seed=sum(ctx_lens) + d,
                                    num_splits=num_splits, norm=norm, padding=1)
    assert out.shape == (len(ctx_lens) + 1, hq, d)
    assert rel_err(out[:n], ref[:n]) < 1e-5
    assert torch.isfinite(out).all()
    for got, want in zip(caches, refs):       # this step's k / v stored; the padding row stored nothing
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_qkv_fp8_cache(dtype):
    out, ref, caches, refs, n = run([5, 40, 17], 4, 2, 32, 8, dtype, seed=3, num_splits=2, fp8_cache=(0.05, 0.004))
    assert rel_err(out[:n], ref[:n]) < (1e-5 if dtype == torch.float32 else 4e-3)
    for got, want in zip(caches, refs):
        # the same byte almost everywhere (the inputs may differ by an ulp of the model dtype)
        assert (got.view(torch.uint8) == want.view(torch.uint8)).float().mean() > 0.99


def test_decode_qkv_refuses_a_wrong_row_width():
    qkv, pos, slots, qw, kw, rot, kc, vc, bt, lens = qkv_case([3], 4, 2, 16, 4, torch.float32, DEVICE, seed=0)
    with pytest.raises(AssertionError, match="qkv"):
        paged_decode_qkv(qkv[:, :-16], pos, slots, qw, kw, rot.cos, rot.sin, EPS, 4, kc, vc, bt, lens, 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 128),
                                     (torch.bfloat16, 256)])
@pytest.mark.parametrize("batch", [1, 4, 64])
@pytest.mark.parametrize("pdl", [False, True])
def test_decode_qkv_gpu(dtype, d, batch, pdl):
    """Qwen3-8B's heads at 500+ context, every model dtype and head size, split (batch 1, 4) and one-piece
    (batch 64) decodes, plainly and under PDL."""
    ctx = [500 + 37 * i for i in range(batch)]
    out, ref, caches, refs, n = run(ctx, 32, 8, d, 16, dtype, seed=batch + d, padding=1, pdl=pdl)
    assert rel_err(out[:n], ref[:n]) < (1e-5 if dtype == torch.float32 else 1e-2)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    for got, want in zip(caches, refs):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_decode_qkv_gpu_fp8_cache():
    out, ref, caches, refs, n = run([600, 31, 64], 32, 8, 128, 16, torch.bfloat16, seed=9, fp8_cache=(0.05, 0.004))
    assert rel_err(out[:n], ref[:n]) < 1e-2
    for got, want in zip(caches, refs):
        assert (got.view(torch.uint8) == want.view(torch.uint8)).float().mean() > 0.99


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_qkv_attends_to_the_new_key_from_registers(num_splits):
    """This step's k and v reach every tile from the registers of the program that made them, never read
    back from the cache it stores them in (on a GPU other threads of the program may not see that store
    yet): with nothing stored (slot -1) the output is still attention over them."""
    ctx_lens, hq, hk, d, bs = [30, 64, 5], 4, 2, 16, 8
    qkv, pos, slots, qw, kw, rot, kc, vc, bt, lens = qkv_case(ctx_lens, hq, hk, d, bs, torch.float32, DEVICE, seed=4)
    kr, vr = kc.clone(), vc.clone()
    q = qk_norm_rope_store_reference(qkv, pos, slots, qw, kw, rot.cos, rot.sin, EPS, hq, hk, d, kr, vr)
    ref = paged_attention_reference(q, kr, vr, lens, bt, 0.25)
    before = kc.clone()
    out = paged_decode_qkv(qkv, pos, torch.full_like(slots, -1), qw, kw, rot.cos, rot.sin, EPS, hq, kc, vc, bt,
                           lens, 0.25, num_splits=num_splits)
    assert torch.equal(kc, before)
    assert rel_err(out, ref) < 1e-5
