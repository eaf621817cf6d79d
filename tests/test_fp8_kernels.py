"""The FP8 kernels (GEMV, W8A8 GEMM, activation quantization, FP8 KV store/decode/prefill) against their
torch references on fresh random inputs: in Triton's interpreter on the CPU, at Qwen3-8B shapes on a GPU."""
from __future__ import annotations

import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels.fp8_gemm import scaled_mm_supported, w8a8_block_linear, w8a8_gemm_per_channel, \
    w8a8_gemm_reference, w8a8_gemm_triton
from llmserve_core.kernels import fp8_gemv as fp8_gemv_module
from llmserve_core.kernels import tuned
from llmserve_core.kernels.fp8_gemv import X_AHEAD_GROUP, choose, default_choice, fp8_gemv, fp8_gemv_a8_reference, \
    fp8_gemv_reference
from llmserve_core.kernels.fp8_quant import quantize_activation, quantize_activation_reference
from llmserve_core.kernels.attention_reference import from_cache, paged_attention_reference
from llmserve_core.kernels.paged_decode import choose_num_splits, paged_decode
from llmserve_core.kernels.paged_prefill import paged_prefill
from llmserve_core.kernels.fp8_format import FP8, FP8_MAX, RowQuant, dequantize_weight, multiplies_fp8_cache_in_f16, \
    quantize_per_block, quantize_per_channel, to_cache_dtype
from llmserve_core.layers.fp8_linear import Fp8Linear
from helpers.kernels import paged_cache, prefill_case, rel_err
from helpers.tuned import fake_card  # noqa: F401  (a fixture)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# FP8 x FP8 products on Hopper's tensor cores are summed with fewer mantissa bits than float32 keeps (the
# reason DeepSeek-V3 promotes its partial sums): against a float32 reference of the same quantized
# operands, about 1e-4 relative on the GPU; exact to float32 rounding in the interpreter.
A8_TOL = 5e-4 if CUDA else 1e-5
# Qwen3-8B's linear layers as (N, K): qkv, o, gate_up, down.
QWEN3_8B_LINEARS = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def random_fp8_weight(n, k, block, gen, device=DEVICE):
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)   # rows of different magnitude
    q, s = quantize_per_channel(w) if block is None else quantize_per_block(w, block)
    return q.to(device), s.to(device)


# ---------------------------------------------------------------- quantization helpers

def test_weight_quantization_round_trips_within_e4m3_precision():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=gen) * 3
    for block in (None, (16, 32)):
        q, s = quantize_per_channel(w) if block is None else quantize_per_block(w, block)
        assert q.dtype == FP8 and s.dtype == torch.float32
        back = dequantize_weight(q, s, block)
        # e4m3 keeps 3 mantissa bits: relative error per element at most 2^-4 of its group's amax.
        assert ((back - w).abs() <= w.abs().amax() * 2 ** -4 + 1e-6).all()
        assert rel_err(back, w) < 0.05


def test_quantization_saturates_and_survives_zeros():
    w = torch.zeros(3, 16)
    w[1, 0] = 1e30
    w[2, :] = 1e-30
    q, s = quantize_per_channel(w)
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all()
    assert q[0].float().abs().sum() == 0 and q[1, 0].float() == FP8_MAX
    assert to_cache_dtype(torch.tensor([1e6, -1e6, float("inf")]), FP8, 1.0).float().tolist() == [448, -448, 448]


@pytest.mark.parametrize("m,k,group,dtype", [(1, 64, None, torch.float32), (5, 300, None, torch.float32),
                                             (7, 256, 128, torch.bfloat16), (3, 200, 64, torch.float32)])
def test_quantize_activation(m, k, group, dtype):
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * 5).to(DEVICE, dtype)
    x[0, :] = 0                                       # an all-zero row keeps a finite scale
    q_ref, s_ref = quantize_activation_reference(x, group)
    for m_major in (False, True):
        q, s = quantize_activation(x, group, m_major=m_major)
        assert s.shape == s_ref.shape and torch.allclose(s, s_ref, rtol=1e-6)
        assert s.stride() == ((1, m) if m_major else (s.shape[1], 1))     # cuBLAS's block scaling reads (1, M)
        # Same float32 division, same round-to-nearest-even cast: bit-equal codes.
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


# ---------------------------------------------------------------- GEMV

@pytest.mark.parametrize("m,n,k,block,block_n,split_k", [
    (1, 48, 96, None, 16, 1),
    (3, 40, 200, None, 16, 3),          # N and K not multiples of the tiles; the last split runs past K
    (16, 64, 128, (32, 32), 32, 1),     # block scales, every row of the 16-row tile real
    (5, 50, 160, (16, 32), 16, 2),      # ragged blocks at both edges, split-K over block scales
    (2, 70, 256, (32, 32), 32, 4),      # split-K: the last split to arrive sums the parked tiles
])
def test_fp8_gemv(m, n, k, block, block_n, split_k):
    gen = torch.Generator().manual_seed(m + n + k)
    w, s = random_fp8_weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    config = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=32, SPLIT_K=split_k, num_warps=4, num_stages=1)
    for _ in range(2):                  # twice: the split-K counters must re-arm themselves
        out = fp8_gemv(x, w, s, block, kernel="dot", config=config)
        assert out.shape == (m, n) and out.dtype == x.dtype
        assert rel_err(out, fp8_gemv_reference(x, w, s, block)) < 1e-5


def test_fp8_gemv_default_config():
    """Whatever the card's rule picks: on one with FP8 products the "a8" kernel (x quantized per piece, its
    own reference), elsewhere the weight widened (the plain reference)."""
    gen = torch.Generator().manual_seed(9)
    # (16-column blocks, the narrowest the loader takes, only in the interpreter: check_fp8_device refuses
    # them on CUDA, whose FP8 products need K tiles of 32)
    for block in (None, (128, 128)) + (() if CUDA else ((16, 16),)):
        w, s = random_fp8_weight(96, 1024, block, gen)
        x = torch.randn(4, 1024, generator=gen).to(DEVICE)
        kernel, cfg = default_choice(tuned.device_spec(x.device), 4, 96, 1024, block)
        ref = (fp8_gemv_a8_reference(x, w, s, block, cfg["BLOCK_K"]) if kernel == "a8"
               else fp8_gemv_reference(x, w, s, block))
        assert rel_err(fp8_gemv(x, w, s, block), ref) < A8_TOL


# bf16/fp16 outputs are rounded once from float32: relative error about 2^-9 / 2^-12 of each value
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


# Triton 3.6's interpreter multiplies bfloat16 dot operands as their raw 16-bit integers, so the
# tensor-core kernel meets bf16 activations on a GPU only (the FMA kernel widens to float32 first).
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=gpu), torch.float16])
def test_fp8_gemv_half_activations(dtype):
    gen = torch.Generator().manual_seed(11)
    for block in (None, (32, 32)):
        w, s = random_fp8_weight(72, 224, block, gen)
        x = torch.randn(6, 224, generator=gen).to(DEVICE, dtype)
        config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1)
        out = fp8_gemv(x, w, s, block, kernel="dot", config=config)
        assert out.dtype == dtype and rel_err(out, fp8_gemv_reference(x, w, s, block)) < OUT_TOL[dtype]


@pytest.mark.parametrize("kernel", ["fma", "fma_late"])
@pytest.mark.parametrize("m,n,k,block,dtype,block_m,block_n,block_k,split_k", [
    (1, 48, 96, None, torch.float32, 1, 16, 32, 1),
    (3, 40, 200, None, torch.bfloat16, 4, 16, 64, 3),        # ragged N and K; the last split runs past K
    (2, 70, 256, (32, 32), torch.float16, 2, 32, 64, 2),     # one K tile spans two scale blocks
    (4, 50, 160, (16, 32), torch.float32, 4, 16, 128, 1),    # ragged blocks at both edges
    (4, 64, 512, (32, 32), torch.bfloat16, 4, 32, 128, 4),   # split-K over block scales
])
def test_fp8_gemv_fma(kernel, m, n, k, block, dtype, block_m, block_n, block_k, split_k):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w, s = random_fp8_weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=1)
    for _ in range(2):                  # twice: the split-K counters must re-arm themselves
        out = fp8_gemv(x, w, s, block, kernel=kernel, config=config)
        assert out.shape == (m, n) and out.dtype == dtype
        assert rel_err(out, fp8_gemv_reference(x, w, s, block)) < OUT_TOL[dtype]


@pytest.mark.parametrize("m,n,k,block,dtype,block_n,split_k", [
    (1, 48, 256, None, torch.float32, 16, 1),
    (3, 40, 200, None, torch.float32, 16, 3),                # ragged N and K; the last split runs past K
    (16, 64, 384, (32, 32), torch.float16, 32, 2),           # a K tile per scale block, split-K
    (5, 50, 160, (16, 32), torch.float32, 16, 1),            # ragged blocks at both edges
])
def test_fp8_gemv_a8(m, n, k, block, dtype, block_n, split_k):
    """W8A8 at 1-16 rows: against its own arithmetic (each row's K tile quantized with its own scale) to
    float precision, and within e4m3's rounding of the activations against the weight-only reference."""
    gen = torch.Generator().manual_seed(m * 5 + n + k)
    w, s = random_fp8_weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    x[0, :7] = 0.0                   # a tile piece of zeros keeps a finite scale
    block_k = 32
    config = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=1)
    for _ in range(2):                  # twice: the split-K counters must re-arm themselves
        out = fp8_gemv(x, w, s, block, kernel="a8", config=config)
        assert out.shape == (m, n) and out.dtype == dtype
        assert rel_err(out, fp8_gemv_a8_reference(x, w, s, block, group=block_k)) < max(OUT_TOL[dtype], 1e-4)
        assert rel_err(out, fp8_gemv_reference(x, w, s, block)) < 4e-2


@pytest.mark.parametrize("m,n,k,block,block_n,group,split_k", [
    (1, 48, 256, None, 16, 32, 1),
    (3, 40, 200, None, 16, 64, 3),                # ragged N and K, two K tiles per x scale, a split past K
    (16, 64, 384, (32, 32), 32, 32, 2),           # block scales, split-K
])
def test_fp8_gemv_on_an_x_quantized_ahead(m, n, k, block, block_n, group, split_k):
    """The a8 kernel reading an e4m3 x with its scales (what a producer kernel could hand it) computes what
    quantizing x in the kernel does, to float precision."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w, s = random_fp8_weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE) * torch.rand(m, 1, generator=gen).to(DEVICE)
    x[0, :40] = 0.0                  # a whole zero group keeps a finite scale
    xq, xs = quantize_activation(x, group)
    config = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=32, SPLIT_K=split_k, num_warps=4, num_stages=1)
    for _ in range(2):                  # twice: the split-K counters must re-arm themselves
        out = fp8_gemv(xq, w, s, block, kernel="a8", config=config, x_scale=xs, x_group=group,
                       out_dtype=torch.float32)
        assert out.shape == (m, n) and out.dtype == torch.float32
        assert rel_err(out, fp8_gemv_a8_reference(x, w, s, block, group=group)) < A8_TOL
    with pytest.raises(AssertionError, match="x_scale"):
        fp8_gemv(xq, w, s, block, kernel="a8", config=config, out_dtype=torch.float32)
    with pytest.raises(AssertionError, match="BLOCK_K must divide"):
        fp8_gemv(xq, w, s, block, kernel="a8", config=dict(config, BLOCK_K=128), x_scale=xs, x_group=group,
                 out_dtype=torch.float32)
    with pytest.raises(AssertionError, match="BLOCK_K must divide"):
        fp8_gemv(xq, w, s, block, kernel="a8", config=config, x_scale=xs, x_group=0, out_dtype=torch.float32)
    with pytest.raises(AssertionError, match="a8 kernel"):
        fp8_gemv(xq, w, s, block, kernel="dot", config=config, x_scale=xs, x_group=group, out_dtype=torch.float32)


@pytest.mark.parametrize("m,n,k,block,block_n,split_k,group", [
    (1, 48, 256, None, 16, 1, None),
    (3, 40, 208, None, 16, 3, None),              # ragged N; K ends inside a tile, the last split past it
    (16, 64, 384, (32, 32), 32, 2, None),         # block scales, split-K, every row of the tile real
    (2, 70, 256, (32, 32), 32, 4, 64),            # x quantized ahead, two K tiles per x scale
])
def test_fp8_gemv_tma_weight_tiles(m, n, k, block, block_n, split_k, group):
    """Weight tiles by tensor descriptor (zero past N and K, as the masked loads give) compute what the
    per-thread loads do: the same numbers in the interpreter, within the FP8 products' summation on a GPU."""
    gen = torch.Generator().manual_seed(m * 11 + n + k)
    w, s = random_fp8_weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    config = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=32, SPLIT_K=split_k, num_warps=4, num_stages=2)
    xin, ahead = x, {}
    if group is not None:               # x quantized ahead, as the RMSNorm before hands it
        xin, xs = quantize_activation(x, group)
        ahead = dict(x_scale=xs, x_group=group, out_dtype=torch.float32)
    plain = fp8_gemv(xin, w, s, block, kernel="a8", config=config, **ahead)
    for _ in range(2):                  # twice: the split-K counters must re-arm themselves
        out = fp8_gemv(xin, w, s, block, kernel="a8", config=dict(config, TMA=True), **ahead)
        assert out.shape == (m, n)
        if CUDA:
            assert rel_err(out, plain) < A8_TOL
        else:
            assert torch.equal(out, plain)
    assert rel_err(out, fp8_gemv_a8_reference(x, w, s, block, group=group or 32)) < A8_TOL
    with pytest.raises(AssertionError, match="TMA"):     # a row pitch TMA cannot take, and a kernel without it
        fp8_gemv(x[:, :200].contiguous(), w[:, :200].contiguous(), s if block is None else s[:, :7], block,
                 kernel="a8", config=dict(config, TMA=True))
    with pytest.raises(AssertionError, match="TMA"):
        fp8_gemv(x, w, s, block, kernel="dot", config=dict(config, TMA=True))


def test_fp8_gemv_fma_refuses_what_it_cannot_tile():
    gen = torch.Generator().manual_seed(5)
    w, s = random_fp8_weight(64, 128, (32, 32), gen)
    x = torch.randn(3, 128, generator=gen).to(DEVICE)
    config = dict(BLOCK_M=2, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=1)
    with pytest.raises(AssertionError, match="rows"):
        fp8_gemv(x, w, s, (32, 32), kernel="fma", config=config)
    with pytest.raises(AssertionError, match="BLOCK_N must divide"):
        fp8_gemv(x[:2], w, s, (32, 32), kernel="fma", config=dict(config, BLOCK_N=64))
    with pytest.raises(AssertionError, match="kernel must be one of"):
        fp8_gemv(x[:2], w, s, (32, 32), kernel="wmma", config=config)
    with pytest.raises(AssertionError, match="kernel must be one of"):        # a tile names no kernel by itself
        fp8_gemv(x[:2], w, s, (32, 32), config=config)
    with pytest.raises(AssertionError, match="comes with its tile"):
        fp8_gemv(x[:2], w, s, (32, 32), kernel="fma")


H200 = tuned.Device("NVIDIA_H200", sms=132, smem=232_448, capability=(9, 0))


def test_choices_fit_the_gpu_at_qwen3_8b_shapes():
    """The tuned table's tiles (the H200's) and the heuristic's (a 78-multiprocessor card no table names, with
    and without FP8 products) at Qwen3-8B's shapes: every tile fits the split-K scratch and its scale blocks,
    the heuristic's fill the card, and the stream kernel is chosen for one row on the decode chain only."""
    for n, k in QWEN3_8B_LINEARS:
        for block in (None, (128, 128)):
            for m in (1, 4, 16):
                tuned_choice = choose(H200, m, n, k, block, stream=True)
                if tuned_choice.kernel == "stream":
                    assert m == 1 and choose(H200, m, n, k, block).kernel == "a8"
                else:
                    tile = tuned_choice.tile
                    n_blocks = -(-n // tile["BLOCK_N"])
                    assert n_blocks * tile["SPLIT_K"] * tile["BLOCK_N"] * 16 <= 8 * 132 * 64 * 16
                    assert block is None or block[1] % tile["BLOCK_K"] == 0
                for capability, kernel in (((9, 0), "a8"), ((8, 0), "dot")):
                    card = tuned.Device("Untuned_Card", sms=78, capability=capability)
                    kernel_here, cfg = choose(card, m, n, k, block, stream=True)
                    assert kernel_here == kernel
                    n_blocks = -(-n // cfg["BLOCK_N"])
                    assert n_blocks * cfg["SPLIT_K"] >= 2 * 78
                    # the split-K scratch bounds every split call (kernels/gemv.py)
                    assert cfg["SPLIT_K"] == 1 or (n_blocks * cfg["SPLIT_K"] * cfg["BLOCK_N"] * cfg["BLOCK_M"]
                                                   <= 8 * 78 * 64 * 16 and n_blocks <= 8 * 78)
                    assert m <= cfg["BLOCK_M"] and (block is None or block[1] % cfg["BLOCK_K"] == 0)


def test_choose_reads_the_table(fake_card):
    """A tuned entry (here a CUDA-core tile for 2-4 rows of 128 x 128 blocks) is what those rows get, and
    only they: another rows class, another scale kind and another card take the heuristic; on a card without
    FP8 products the heuristic widens the weight."""
    entry = {"kernel": "fma", "tile": dict(BLOCK_M=4, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=3)}
    card = fake_card({"fp8_gemv": [({"N": 4096, "K": 4096, "rows": 4, "scale": "128x128", "x": "raw"}, entry)]})
    for m in (2, 3, 4):
        assert choose(card, m, 4096, 4096, (128, 128)) == ("fma", entry["tile"])
    assert choose(card, 1, 4096, 4096, (128, 128)).tile != entry["tile"]           # another rows class
    assert choose(card, 4, 4096, 4096, None).tile != entry["tile"]                 # another scale kind
    other = tuned.Device("Other_Card", sms=132, capability=(9, 0))
    assert choose(other, 4, 4096, 4096, (128, 128)).tile != entry["tile"]         # another card: the heuristic
    assert choose(tuned.Device("Old_Card", sms=132), 4, 4096, 4096, (128, 128)).kernel == "dot"   # no FP8 products


# ---------------------------------------------------------------- W8A8 GEMM

@pytest.mark.parametrize("m,n,k,block", [(20, 48, 64, None), (33, 40, 100, None), (40, 64, 128, (32, 32)),
                                         (17, 50, 96, (16, 32)),
                                         pytest.param(24, 48, 64, (16, 16), marks=pytest.mark.skipif(
                                             CUDA, reason="16-column blocks are refused on CUDA"))])
def test_w8a8_gemm_triton(m, n, k, block):
    gen = torch.Generator().manual_seed(m * n + k)
    w, ws = random_fp8_weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    for m_major in (False, True) if block else (False,):     # the Triton kernel reads either scale layout
        a, a_s = quantize_activation(x, None if block is None else block[1], m_major=m_major)
        out = w8a8_gemm_triton(a, a_s, w, ws, block, torch.float32)
        assert rel_err(out, w8a8_gemm_reference(a, a_s, w, ws, block, torch.float32)) < A8_TOL
        # and the whole W8A8 product stays near the unquantized one
        assert rel_err(out, x @ dequantize_weight(w, ws, block).t()) < 0.08


def test_scaled_mm_takes_block_scales_only_where_cublas_runs_them(monkeypatch):
    import llmserve_core.kernels.fp8_gemm as fp8_gemm_module
    cuda, cap = torch.device("cuda"), [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    monkeypatch.setattr(fp8_gemm_module, "TORCH_VERSION", (2, 11))
    monkeypatch.setattr(fp8_gemm_module, "CUDA_VERSION", (13, 0))
    block = (128, 128)
    for n, k in QWEN3_8B_LINEARS:
        assert scaled_mm_supported(cuda, n, k, torch.bfloat16, block)
    assert not scaled_mm_supported(torch.device("cpu"), 4096, 4096, torch.bfloat16, block)
    assert not scaled_mm_supported(cuda, 4096, 4096, torch.float16, block)          # bf16 out only
    assert not scaled_mm_supported(cuda, 4096, 4096, torch.bfloat16, (64, 128))     # cuBLAS's blocks are 128
    assert not scaled_mm_supported(cuda, 4000, 4096, torch.bfloat16, block)         # a partial block of rows
    assert not scaled_mm_supported(cuda, 4096, 4224, torch.bfloat16, block)         # 33 K blocks: padded scales
    for attr, old in (("TORCH_VERSION", (2, 8)), ("CUDA_VERSION", (12, 8))):
        monkeypatch.setattr(fp8_gemm_module, attr, old)
        assert not scaled_mm_supported(cuda, 4096, 4096, torch.bfloat16, block)
        monkeypatch.setattr(fp8_gemm_module, attr, (99, 0))
    for other in ((8, 9), (10, 0)):       # torch refuses the layout off sm90; row-wise stays
        cap[0] = other
        assert not scaled_mm_supported(cuda, 4096, 4096, torch.bfloat16, block)
        assert scaled_mm_supported(cuda, 4096, 4096, torch.bfloat16)


def test_block_scaled_gemm_hands_cublas_the_scale_layouts_torch_checks(monkeypatch):
    """w8a8_block_linear's call of torch._scaled_mm, held to the layouts torch accepts for 1 x 128 by 128 x
    128 scaling (aten ScaledBlas: a's scales [M, K/128] with strides (1, M); b = w.t() checked as b.t() with
    scale_b.t(): [N/128, K/128] with strides (K/128, 1)) and to the rows cuBLAS took (padded to a multiple
    of CUBLAS_BLOCK_ROWS), computing what those scales mean."""
    import llmserve_core.kernels.fp8_gemm as fp8_gemm_module
    monkeypatch.setattr(fp8_gemm_module, "scaled_mm_supported", lambda *args: True)
    calls = []

    def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype):
        m, k = a.shape
        n = b.shape[1]
        assert m % fp8_gemm_module.CUBLAS_BLOCK_ROWS == 0
        assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)
        assert scale_b.t().shape == (n // 128, k // 128) and scale_b.t().stride() == (k // 128, 1)
        calls.append(m)
        a_deq = a.float() * scale_a.repeat_interleave(128, 1)
        b_deq = b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return (a_deq @ b_deq).to(out_dtype)
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    gen = torch.Generator().manual_seed(5)
    w, ws = random_fp8_weight(256, 512, (128, 128), gen)
    x = torch.randn(20, 512, generator=gen).to(DEVICE)
    a, a_s = quantize_activation(x, 128)
    ref = w8a8_gemm_reference(a, a_s, w, ws, (128, 128), torch.float32)
    out = w8a8_block_linear(x, w, ws, (128, 128), torch.float32)
    assert out.shape == (20, 256) and calls == [20] and rel_err(out, ref) < 1e-6
    assert w8a8_block_linear(x[:17], w, ws, (128, 128), torch.float32).shape == (17, 256) and calls == [20, 20]
    # the padding rows are zeros with a finite scale, whatever x's memory held past its rows
    q, s = quantize_activation(x[:3], 128, m_major=True, pad_rows_to=16)
    assert q.shape == (16, 512) and s.shape == (16, 4) and s.stride() == (1, 16)
    assert (q[3:].float() == 0).all() and torch.isfinite(s).all()
    assert torch.equal(q[:3].view(torch.uint8), a[:3].view(torch.uint8)) and torch.equal(s[:3], a_s[:3])
    # where cuBLAS does not take the layout, the Triton kernel runs
    monkeypatch.setattr(fp8_gemm_module, "scaled_mm_supported", lambda *args: False)
    assert rel_err(w8a8_block_linear(x, w, ws, (128, 128), torch.float32), ref) < A8_TOL and calls == [20, 20]


def fp8_layer_on_a_tuned_card(n, k, block, seed, fake_card, tables):
    """An Fp8Linear of random weights on a card (faked: FP8 products, 132 multiprocessors) whose fp8_gemv
    table holds `tables` [(shape without N, K, scale; config)], and the generator that made them."""
    scale = tuned.scale_key(block)
    fake_card({"fp8_gemv": [(dict(shape, N=n, K=k, scale=scale), cfg) for shape, cfg in tables]})
    gen = torch.Generator().manual_seed(seed)
    layer = Fp8Linear(k, n, block).to(DEVICE)
    layer.quantize_rows_(torch.randn(n, k, generator=gen))
    return layer, gen


@pytest.mark.parametrize("m,n,k,block,x_group,kernel", [
    (1, 80, 256, None, 0, "a8"),
    (3, 44, 200, None, 64, "a8"),                 # x quantized ahead; ragged K, the last program's columns cut short
    (16, 96, 256, (16, 32), 32, "a8"),            # block scales: gate and up rows in different block rows
    (2, 64, 128, (32, 32), 0, "dot"),
])
def test_fp8_gemv_ends_in_the_silu_mul(m, n, k, block, x_group, kernel):
    """silu_mul: over a packed [gate | up] weight, the SiLU-and-mul of the kernel's own products (each
    arithmetic's reference, in float32); a tile that splits K (or another kernel) is refused."""
    from llmserve_core.kernels.silu_mul import silu_mul_reference
    gen = torch.Generator().manual_seed(m + n + k)
    w, s = random_fp8_weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=1)
    if x_group:
        xq, xs = quantize_activation(x, x_group)
        out = fp8_gemv(xq, w, s, block, kernel=kernel, config=config, x_scale=xs, x_group=x_group,
                       out_dtype=torch.float32, silu_mul=True)
        products = fp8_gemv_a8_reference(x, w, s, block, group=x_group)
    else:
        out = fp8_gemv(x, w, s, block, kernel=kernel, config=config, silu_mul=True)
        products = (fp8_gemv_a8_reference(x, w, s, block, group=32) if kernel == "a8" else
                    fp8_gemv_reference(x, w, s, block))
    assert out.shape == (m, n // 2) and out.dtype == torch.float32
    assert rel_err(out, silu_mul_reference(products)) < (A8_TOL if kernel == "a8" else 1e-5)
    for bad_kernel, bad in ((kernel, dict(config, SPLIT_K=2)), ("fma", dict(config, BLOCK_N=16))):
        with pytest.raises(AssertionError, match="silu_mul"):
            fp8_gemv(x, w, s, block, kernel=bad_kernel, config=bad, silu_mul=True)


@pytest.mark.parametrize("block", [None, (32, 32)])
@torch.no_grad()
def test_fp8_linear_folds_the_silu_mul_where_its_tile_keeps_k_whole(block, fake_card):
    """A packed [gate | up] Fp8Linear says it can end its rows in the SiLU-and-mul where the tile those rows
    take (x quantized ahead where input_quant asks for it, else the GEMV's, the stream kernel's whole rows at
    one row) does not split K; handed its rows as input_quant asks, it computes the unfolded layer's
    products' SiLU-and-mul. Elsewhere it says it cannot, and refuses."""
    from llmserve_core.kernels.silu_mul import silu_mul_reference
    from llmserve_core.layers.fp8_linear import QuantizedRows
    n, k = 64, 128
    whole_k = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=1)
    layer, gen = fp8_layer_on_a_tuned_card(n, k, block, 13, fake_card, [
        ({"rows": 1, "x": "raw"}, {"kernel": "stream"}),
        ({"rows": 4, "x": "raw"}, {"kernel": "a8", "tile": dict(whole_k, SPLIT_K=2)}),
        ({"rows": 16, "x": "fp8"}, {"kernel": "a8", "tile": whole_k}),
        ({"rows": 32, "x": "raw"}, {"kernel": "a8", "tile": dict(whole_k, BLOCK_M=32)})])
    assert not layer.folds_silu_mul(1)                  # off the fast path
    layer.fused, layer.fast_kernel = True, "stream"
    folds = {rows: layer.folds_silu_mul(rows) for rows in (1, 3, 10, 20, 65)}
    assert folds == {1: True, 3: False, 10: True, 20: True, 65: False}
    for rows, folded in folds.items():
        x = torch.randn(rows, k, generator=gen).to(DEVICE)
        quant = layer.input_quant(rows, torch.float32)
        handed = x if quant is None else QuantizedRows(*quantize_activation(x, quant.group), quant, rows, torch.float32)
        if not folded:
            with pytest.raises(AssertionError, match="SiLU-and-mul"):
                layer(handed, silu_mul=True)
            continue
        out = layer(handed, silu_mul=True)
        assert out.shape == (rows, n // 2)
        assert rel_err(out, silu_mul_reference(layer(handed))) < A8_TOL, rows


def test_fp8_linear_matches_its_dequantized_twin():
    gen = torch.Generator().manual_seed(3)
    for block in (None, (16, 32)):
        layer = Fp8Linear(64, 48, block)
        layer.quantize_rows_(torch.randn(32, 64, generator=gen))
        layer.quantize_rows_(torch.randn(16, 64, generator=gen), 32)        # a second packed shard
        x = torch.randn(2, 3, 64, generator=gen)
        out = layer(x)
        assert out.shape == (2, 3, 48)
        assert torch.allclose(out, x @ layer.dequantized_weight().t(), atol=1e-5)
        assert layer(torch.zeros(0, 64)).shape == (0, 48)



@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("producer,rows", [("rmsnorm", 65), ("rmsnorm", 68), ("silu_mul", 66)])
def test_fp8_linear_past_the_gemv_reads_the_rows_its_producer_quantized(producer, rows, block):
    """Past the GEMV's rows the W8A8 GEMM takes its rows as the RMSNorm or the SiLU-and-mul before it
    quantized them (one scale a token per channel; per 1 x 128 piece for blocks, M-major and padded to a
    multiple of 4 rows where cuBLAS runs them): the same output as the layer quantizing the plain rows
    itself (bit-equal in the interpreter; on a GPU the two kernels' float32 divisions may differ by an ulp)."""
    from llmserve_core.kernels.fp8_gemm import w8a8_block_input
    from llmserve_core.kernels.rmsnorm import rmsnorm
    from llmserve_core.kernels.silu_mul import silu_mul
    from llmserve_core.layers.fp8_linear import QuantizedRows
    gen = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if CUDA else torch.float32
    n, k = 128, 512             # the smallest shape cuBLAS's block scaling takes
    layer = Fp8Linear(k, n, block).to(DEVICE)
    layer.quantize_rows_(torch.randn(n, k, generator=gen))
    layer.fused = True
    quant = layer.input_quant(rows, dtype)
    assert quant == (RowQuant(k) if block is None else w8a8_block_input(layer.weight, layer.weight_scale, block, dtype))
    assert quant.m_major == (block is not None and CUDA and torch.cuda.get_device_capability() == (9, 0))
    if producer == "rmsnorm":
        x, w = (torch.randn(rows, k, generator=gen) * 2).to(DEVICE, dtype), torch.randn(k, generator=gen).to(DEVICE, dtype)
        plain, ahead = rmsnorm(x, w, 1e-6), rmsnorm(x, w, 1e-6, quant=quant)
    else:
        x = (torch.randn(rows, 2 * k, generator=gen) * 2).to(DEVICE, dtype)
        plain, ahead = silu_mul(x), silu_mul(x, quant=quant)
    out = layer(QuantizedRows(*ahead, quant, rows, dtype))
    want = layer(plain)
    assert out.shape == want.shape == (rows, n)
    if CUDA:
        assert rel_err(out, want) < 1e-2
    else:
        assert torch.equal(out, want)


@pytest.mark.parametrize("block", [None, (32, 32)])
def test_fp8_linear_takes_the_gemv_past_16_rows_only_where_its_table_names_a_tile(block, monkeypatch, fake_card):
    """1-16 rows always take the GEMV; 17-64 take it only for a rows class (32: 17-32, 64: 33-64) the table
    has a tile for, on a card like the measured one (faked: FP8 products, 132 multiprocessors); other rows
    quantize x and run the W8A8 GEMM. Each path agrees with its reference, and input_quant asks for rows
    quantized ahead where the x-ahead table has the rows class (the GEMV's layout) and wherever the W8A8 GEMM
    runs (the GEMM's)."""
    from llmserve_core.layers.fp8_linear import TABLE_GEMV_MAX_ROWS, QuantizedRows
    assert TABLE_GEMV_MAX_ROWS == fp8_gemv_module.MAX_ROWS      # repeated so a CPU install needs no Triton
    n, k = 64, 128
    tile = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1)
    layer, gen = fp8_layer_on_a_tuned_card(n, k, block, 11, fake_card, [
        ({"rows": 32, "x": "raw"}, {"kernel": "a8", "tile": tile}),
        ({"rows": 64, "x": "fp8"}, {"kernel": "a8", "tile": dict(tile, BLOCK_M=64)})])
    layer.fused = True
    took = []
    for path in ("_gemv", "_w8a8", "_gemv_quantized"):
        real = getattr(Fp8Linear, path)
        monkeypatch.setattr(Fp8Linear, path, lambda self, *a, real=real, path=path: took.append(path) or real(self, *a))
    w, ws = layer.weight, layer.weight_scale
    for rows, path in ((16, "_gemv"), (17, "_gemv"), (32, "_gemv"), (33, "_w8a8"), (64, "_w8a8"), (65, "_w8a8")):
        x = torch.randn(rows, k, generator=gen).to(DEVICE)
        took.clear()
        out = layer(x)
        assert took == [path], rows
        if path == "_gemv":         # the table's tile past 16 rows, else the rule's (BLOCK_K 128, or the block's 32)
            group = 32 if rows > 16 else choose(tuned.device_spec(w.device), rows, n, k, block).tile["BLOCK_K"]
            ref = fp8_gemv_a8_reference(x, w, ws, block, group=group)
        else:
            ref = w8a8_gemm_reference(*quantize_activation(x, None if block is None else block[1]), w, ws, block,
                                      torch.float32)
        assert rel_err(out, ref) < A8_TOL, rows
        gemm_input = RowQuant(k if block is None else block[1])     # on the CPU the Triton GEMM's layout
        want = {16: None, 17: None, 32: None, 65: gemm_input}.get(rows, RowQuant(X_AHEAD_GROUP))
        assert layer.input_quant(rows, torch.float32) == want, rows
    # Rows quantized ahead as input_quant asks (as the RMSNorm before hands them): 33-64 take the x-ahead
    # tile, 65 the W8A8 GEMM without a quantization of its own
    for rows, path in ((40, "_gemv_quantized"), (65, "_w8a8")):
        x = torch.randn(rows, k, generator=gen).to(DEVICE)
        quant = layer.input_quant(rows, torch.float32)
        took.clear()
        out = layer(QuantizedRows(*quantize_activation(x, quant.group), quant, rows, torch.float32))
        assert took == [path] and out.shape == (rows, n)
        ref = (fp8_gemv_a8_reference(x, w, ws, block, group=X_AHEAD_GROUP) if path == "_gemv_quantized" else
               w8a8_gemm_reference(*quantize_activation(x, quant.group), w, ws, block, torch.float32))
        assert rel_err(out, ref) < A8_TOL, rows


# ---------------------------------------------------------------- FP8 KV cache

def fp8_cache(kc, vc, k_scale, v_scale):
    return to_cache_dtype(kc, FP8, k_scale), to_cache_dtype(vc, FP8, v_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32])
def test_paged_decode_fp8_cache(dtype):
    gen = torch.Generator().manual_seed(11)
    seq_lens = [5, 40, 17, 0]
    kc, vc, bt = paged_cache(seq_lens, 8, 2, 16, torch.float32, DEVICE, gen)
    kc8, vc8 = fp8_cache(kc * 3, vc * 0.2, 0.05, 0.004)
    q = torch.randn(len(seq_lens), 4, 16, generator=gen).to(device=DEVICE, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    for splits in (1, 4):
        out = paged_decode(q, kc8, vc8, bt, lens, 0.3, num_splits=splits, k_scale=0.05, v_scale=0.004)
        ref = paged_attention_reference(q, kc8, vc8, lens, bt, 0.3, k_scale=0.05, v_scale=0.004)
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    # the FP8 cache stays close to the float one it was made from
    full = paged_attention_reference(q, kc * 3, vc * 0.2, lens, bt, 0.3)
    assert rel_err(ref, full) < 0.1


def test_a_16_bit_query_meets_an_fp8_cache_in_float16():
    """bf16 q over an FP8 cache: the dots run in float16, which holds every e4m3 value and every bf16 query
    component up to 65504. A query past that (bf16 reaches 3e38) gives the same attention, not inf / NaN
    and not a clamped query's (which would pick other keys once the softmax is all but one-hot)."""
    assert multiplies_fp8_cache_in_f16(torch.bfloat16, FP8) and multiplies_fp8_cache_in_f16(torch.float16, FP8)
    assert not multiplies_fp8_cache_in_f16(torch.float32, FP8)
    assert not multiplies_fp8_cache_in_f16(torch.bfloat16, torch.bfloat16)
    q, kc, vc, bt, qsl, lens, _ = prefill_case([5, 1, 3], [40, 9, 0], 4, 2, 16, 8, torch.float32, DEVICE, 21)
    kc8, vc8 = fp8_cache(kc, vc, 0.01, 0.02)
    q = q.to(torch.bfloat16)
    dec_q = q[qsl[1:].long() - 1]                       # each sequence's last row, as a decode brings it
    for big in (False, True):
        if big:       # past float16's 65504 (bf16 holds it); every row's softmax is then all but one-hot
            q = q * 1e5
            dec_q = dec_q * 1e5
        kw = dict(k_scale=0.01, v_scale=0.02)
        out = paged_prefill(q, kc8, vc8, qsl, lens, bt, 5, 0.25, **kw)
        ref = paged_attention_reference(q, kc8, vc8, lens, bt, query_start_loc=qsl, scale=0.25, **kw)
        assert out.isfinite().all() and rel_err(out, ref) < 5e-3
        out = paged_decode(dec_q, kc8, vc8, bt, lens, 0.25, num_splits=2, **kw)
        ref = paged_attention_reference(dec_q, kc8, vc8, lens, bt, 0.25, **kw)
        assert out.isfinite().all() and rel_err(out, ref) < 5e-3


def test_paged_prefill_fp8_cache():
    q, kc, vc, bt, qsl, lens, _ = prefill_case([5, 33, 3], [7, 40, 0], 4, 2, 16, 4, torch.float32, DEVICE, 5)
    kc8, vc8 = fp8_cache(kc, vc, 0.02, 0.5)
    out = paged_prefill(q, kc8, vc8, qsl, lens, bt, 33, 0.25, k_scale=0.02, v_scale=0.5)
    ref = paged_attention_reference(q, kc8, vc8, lens, bt, query_start_loc=qsl, scale=0.25, k_scale=0.02, v_scale=0.5)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(from_cache(kc8, 0.02), kc8.float() * 0.02)


@pytest.mark.parametrize("rows,tree", [(4, False), (3, True)])
def test_decode_rows_fp8_cache(rows, tree):
    """A speculative verify's rows through the decode kernel over an FP8 cache."""
    q, kc, vc, bt, qsl, lens, mask = prefill_case([rows] * 3, [7, 40, 0], 4, 2, 16, 4, torch.float32, DEVICE,
                                                  seed=rows, tree=tree)
    kc8, vc8 = fp8_cache(kc, vc, 0.03, 0.2)
    out = paged_decode(q, kc8, vc8, bt, lens, 0.3, num_splits=2, rows_per_seq=rows, tree_mask=mask,
                       k_scale=0.03, v_scale=0.2)
    ref = paged_attention_reference(q, kc8, vc8, lens, bt, query_start_loc=qsl, scale=0.3, tree_mask=mask, k_scale=0.03, v_scale=0.2)
    assert rel_err(out, ref) < 1e-5


def test_scales_are_ignored_for_a_bf16_cache():
    q, kc, vc, bt, qsl, lens, _ = prefill_case([6, 2], [3, 9], 4, 2, 16, 8, torch.float32, DEVICE, 9)
    plain = paged_prefill(q, kc, vc, qsl, lens, bt, 6, 0.25)
    scaled = paged_prefill(q, kc, vc, qsl, lens, bt, 6, 0.25, k_scale=7.0, v_scale=3.0)
    assert torch.equal(plain, scaled)


# ---------------------------------------------------------------- Qwen3-8B shapes on the GPU

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN3_8B_LINEARS)
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_linears_at_qwen3_8b_shapes(n, k, block):
    gen = torch.Generator().manual_seed(n + k)
    w, ws = random_fp8_weight(n, k, block, gen, "cuda")
    for m in (1, 4, 16, 17, 32, 33, 64):
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        # the card's default (the "a8" kernel at the tuned tile on an H100 or H200, the heuristic's past it:
        # 17-64 rows run in the engine only where the table has a tile), then widening the weight
        card = tuned.device_spec(x.device)
        kernel, a8 = default_choice(card, m, n, k, block)
        assert kernel == "a8"
        for pdl in (False, True):
            out = fp8_gemv(x, w, ws, block, kernel="a8", config=a8, pdl=pdl)
            assert rel_err(out, fp8_gemv_a8_reference(x, w, ws, block, group=a8["BLOCK_K"])) < 8e-3
            assert rel_err(out, fp8_gemv_reference(x, w, ws, block)) < 4e-2
            # the same tile with its weight brought by TMA (benchmarks/fp8_tma_tiles.py's candidates)
            tma = fp8_gemv(x, w, ws, block, kernel="a8", config=dict(a8, TMA=True), pdl=pdl)
            assert rel_err(tma, out) < A8_TOL
        ahead = choose(card, m, n, k, block, x="fp8")
        if ahead is not None:       # the tile for x quantized ahead (by the RMSNorm before), under PDL too
            xq, xs = quantize_activation(x, X_AHEAD_GROUP)
            for pdl in (False, True):
                out = fp8_gemv(xq, w, ws, block, kernel=ahead.kernel, config=ahead.tile, pdl=pdl, x_scale=xs,
                               x_group=X_AHEAD_GROUP, out_dtype=torch.bfloat16)
                assert rel_err(out, fp8_gemv_a8_reference(x, w, ws, block, group=X_AHEAD_GROUP)) < 8e-3
        kernel, dot = default_choice(tuned.Device("No_FP8_Card", sms=card.sms), m, n, k, block)
        assert kernel == "dot"
        assert rel_err(fp8_gemv(x, w, ws, block, kernel="dot", config=dot), fp8_gemv_reference(x, w, ws, block)) < 1e-2
        if m <= 4:      # the CUDA-core kernel, K tiles spanning two scale blocks, split-K
            fma = dict(BLOCK_M=m, BLOCK_N=32, BLOCK_K=256, SPLIT_K=4, num_warps=4, num_stages=3)
            assert rel_err(fp8_gemv(x, w, ws, block, kernel="fma", config=fma),
                           fp8_gemv_reference(x, w, ws, block)) < 1e-2
    for m in (17, 64, 256, 1000):
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        a, a_s = quantize_activation(x, None if block is None else block[1])
        ref = w8a8_gemm_reference(a, a_s, w, ws, block, torch.float32)
        if block is None:
            assert rel_err(w8a8_gemm_per_channel(a, a_s, w, ws, torch.bfloat16), ref) < 1e-2
            assert rel_err(w8a8_gemm_triton(a, a_s.view(-1, 1), w, ws, None, torch.bfloat16), ref) < 1e-2
        else:
            assert rel_err(w8a8_gemm_triton(a, a_s, w, ws, block, torch.bfloat16), ref) < 1e-2
            # the layer's path: cuBLAS's block-scaled GEMM (rows padded) where scaled_mm_supported says so
            out = w8a8_block_linear(x, w, ws, block, torch.bfloat16)
            assert out.shape == (m, n) and rel_err(out, ref) < 1e-2
            a, a_s = quantize_activation(x, block[1], m_major=True)       # Triton on M-major scales
            assert rel_err(w8a8_gemm_triton(a, a_s, w, ws, block, torch.bfloat16), ref) < 1e-2
    # the layer's dispatch: empty, GEMV and W8A8 row counts against the weight-only reference
    layer = Fp8Linear(k, n, block).to("cuda")
    layer.fused = True
    layer.weight.copy_(w)
    layer.weight_scale.copy_(ws)
    for m in (0, 1, 16, 17, 300):
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        out = layer(x)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        if m:    # W8A8 also rounds the activations to e4m3: a looser bound than a weight-only GEMV's
            assert rel_err(out, fp8_gemv_reference(x, w, ws, block)) < 8e-2


@gpu
@pytest.mark.gpu
def test_fp8_kv_at_qwen3_8b_shapes():
    gen = torch.Generator().manual_seed(8)
    seq_lens = [4096, 1, 777, 2048]
    kc, vc, bt = paged_cache(seq_lens, 16, 8, 128, torch.float32, "cuda", gen)
    kc8, vc8 = fp8_cache(kc, vc, 0.01, 0.02)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(4, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    out = paged_decode(q, kc8, vc8, bt, lens, 128 ** -0.5, k_scale=0.01, v_scale=0.02)
    assert rel_err(out, paged_attention_reference(q, kc8, vc8, lens, bt, 128 ** -0.5, k_scale=0.01, v_scale=0.02)) < 2e-2
    # 40 sequences take the one-piece decode and its FP8 tile (FP8_DECODE_BLOCK_N keys, ragged last tiles)
    seq_lens = [1 + (37 * i) % 700 for i in range(40)]
    kc, vc, bt = paged_cache(seq_lens, 16, 8, 128, torch.float32, "cuda", gen)
    kc8, vc8 = fp8_cache(kc, vc, 0.01, 0.02)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(40, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    assert choose_num_splits(40, 8) == 1
    out = paged_decode(q, kc8, vc8, bt, lens, 128 ** -0.5, k_scale=0.01, v_scale=0.02)
    assert rel_err(out, paged_attention_reference(q, kc8, vc8, lens, bt, 128 ** -0.5, k_scale=0.01, v_scale=0.02)) < 5e-3
    q, kc, vc, bt, qsl, lens, _ = prefill_case([512, 1, 300], [0, 900, 64], 32, 8, 128, 16, torch.float32, "cuda", 1)
    kc8, vc8 = fp8_cache(kc, vc, 0.01, 0.02)
    q = q.to(torch.bfloat16)
    out = paged_prefill(q, kc8, vc8, qsl, lens, bt, 512, 128 ** -0.5, k_scale=0.01, v_scale=0.02)
    ref = paged_attention_reference(q, kc8, vc8, lens, bt, query_start_loc=qsl, scale=128 ** -0.5, k_scale=0.01, v_scale=0.02)
    assert rel_err(out, ref) < 2e-2


def test_fp8_gemv_sweep_smoke(tmp_path):
    """benchmarks/fp8_gemv_sweep.py --a8x on tiny shapes in the interpreter, so the script the device runs
    cannot rot unseen: every tile, x quantized ahead or in the kernel, checked against its reference."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_gemv_sweep.py"
    out = tmp_path / "sweep.json"
    subprocess.run([sys.executable, str(script), "--smoke", "--a8x", "--out", str(out), "--configs",
                    str(tmp_path / "configs")], check=True, timeout=600, capture_output=True)
    res = json.loads(out.read_text())
    cases = res["cases"]
    assert len(cases) == 4                              # two shapes x two scale kinds, one row
    for rows in cases.values():
        assert {lbl.split("_")[0] for lbl in rows} >= {"current", "a8x", "a8"}, rows
        assert all("error" not in r and r["rel_err"] < 1e-5 for r in rows.values()), rows
    # the winners went into this "card's" table through the writer: one row quantized ahead, wherever an a8x
    # tile beat every tile on x as it is
    table = json.loads((tmp_path / "configs" / "fp8_gemv" / "device=cpu.json").read_text())
    assert res["tables"] == [str(tmp_path / "configs" / "fp8_gemv" / "device=cpu.json")]
    assert table["keys"] == ["N", "K", "rows", "scale", "x"]
    assert table["sources"] == ["benchmarks/fp8_gemv_sweep.py --a8x (sweep.json)"]
    for key, entry in table["configs"].items():
        assert key.endswith(",rows=1,scale=channel,x=fp8") or key.endswith(",rows=1,scale=128x128,x=fp8"), key
        assert entry["kernel"] == "a8" and entry["tile"]["BLOCK_K"] in (64, 128)
