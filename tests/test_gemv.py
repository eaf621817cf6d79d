"""The skinny-matmul kernel and the Linear layer's fast path against their torch references.

On the CPU the kernel runs in Triton's interpreter, which rounds to bfloat16 by truncation where torch
rounds to nearest, and cannot run tensor-core dots on bfloat16 at all: there the kernel is checked in
float16 and float32 (tightly), and in bfloat16 on the GPU.
"""
from __future__ import annotations

import itertools
import json

import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels import gemv as gemv_module
from llmserve_core.kernels import tuned
from llmserve_core.kernels.gemv import (MAX_ROWS, PROJECTION_MAX_ROWS, gemv, gemv_argmax, gemv_reference,
                                        projection_tiles, row_tile, split_k_tile)
from llmserve_core.kernels.tiling import fit_gemv_config, gemv_smem_bytes
from llmserve_core.layers import linear as linear_module
from llmserve_core.layers.linear import Linear
from helpers.kernels import CUDA, DEVICE, TOL, rel_err
from helpers.kernels import gemv_inputs as inputs
from helpers.tuned import fake_card  # noqa: F401  (a fixture)

def test_limits_agree():
    assert (MAX_ROWS, PROJECTION_MAX_ROWS) == (linear_module.MAX_ROWS, linear_module.PROJECTION_MAX_ROWS)


@pytest.mark.parametrize("m,shape,dtype", list(itertools.product(
    [1, 2, 3, 5, 16, 17, 40, 64], [(48, 64), (37, 80), (130, 512)],
    [torch.float32, torch.float16, torch.bfloat16])))
def test_gemv_matches_reference(m, shape, dtype):
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("Triton's interpreter has no bfloat16 dot")
    n, k = shape
    x, w = inputs(m, n, k, dtype, seed=m * 1000 + n)
    out = gemv(x, w)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, gemv_reference(x, w)) <= TOL[dtype]


def test_gemv_float32_logits():
    x, w = inputs(3, 70, 48, torch.float16, seed=7)
    out = gemv(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.isfinite().all()
    assert rel_err(out, gemv_reference(x, w, out_dtype=torch.float32)) <= TOL[torch.float16]


def test_gemv_refuses_what_it_cannot_do():
    x, w = inputs(MAX_ROWS + 1, 16, 32, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="at most"):
        gemv(x, w)
    with pytest.raises(AssertionError, match="does not match"):
        gemv(x[:2, :16], w)


@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288), (151936, 4096), (48, 64)])
def test_config_fills_the_device_and_splits_k_evenly(n, k):
    for m in (1, 7, 16, 17, 33, MAX_ROWS):
        cfg = split_k_tile(m, n, k, sms=132)
        assert cfg["BLOCK_M"] == row_tile(m) >= m and (row_tile(m) == 16 or row_tile(m) // 2 < m)
        programs = -(-n // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
        assert cfg["SPLIT_K"] == 1 or (programs <= 8 * 132 and k % (cfg["SPLIT_K"] * cfg["BLOCK_K"]) == 0)
        if k >= 4096:
            assert programs >= 4 * 132 or cfg["SPLIT_K"] == 16


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_reduces_once_and_rearms(split):
    """Two calls in a row through the same counters: the second must see them re-armed to zero."""
    x, w = inputs(3, 128, 256, torch.float32, seed=split)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=split, num_warps=4, num_stages=2)
    first, second = gemv(x, w, config=cfg), gemv(x * 2, w, config=cfg)
    ref = gemv_reference(x, w)
    assert rel_err(first, ref) < 1e-5 and rel_err(second, 2 * ref) < 1e-5


H200_SMEM = 232_448
H200 = tuned.Device("NVIDIA_H200", sms=132, smem=H200_SMEM, capability=(9, 0))


def h200_table() -> dict:
    """The H200's tuned gemv tiles: {(N, K, rows, dtype): tile}."""
    table = json.loads(tuned.config_path("gemv", "NVIDIA H200").read_text())["configs"]
    return {tuple(int(v) if v.isdigit() else v for v in (p.split("=")[1] for p in key.split(","))): cfg
            for key, cfg in table.items()}


def test_tuned_tiles_fit_the_h200_as_measured_and_float32_is_fitted():
    """Every tuned bf16 tile fits the H200 unchanged; in float32 the fit gives up stages first, keeps
    within the limit, and reaches a tile for any row tile of any table shape; past the smallest tile it
    says so."""
    table = h200_table()
    for (n, k, rows, dtype), cfg in table.items():
        assert fit_gemv_config(cfg, 2, 2, H200_SMEM) == cfg
        fitted = fit_gemv_config(cfg, 4, 4, H200_SMEM)
        assert gemv_smem_bytes(fitted, 4, 4) <= H200_SMEM
        assert fitted["BLOCK_M"] == cfg["BLOCK_M"] and fitted["num_stages"] <= cfg["num_stages"]
    lm_head = table[(151936, 4096, 64, "bf16")]
    assert gemv_smem_bytes(lm_head, 4, 4) > H200_SMEM
    assert fit_gemv_config(lm_head, 4, 4, H200_SMEM) == dict(lm_head, num_stages=2)
    for m in (16, 32, 64):            # a card with 100 KB: narrower tiles, never over
        small = fit_gemv_config(split_k_tile(m, 151936, 4096, 132), 4, 4, 100 * 1024)
        assert gemv_smem_bytes(small, 4, 4) <= 100 * 1024 and small["BLOCK_M"] == row_tile(m)
    with pytest.raises(ValueError, match="does not fit"):
        fit_gemv_config(split_k_tile(64, 4096, 4096, 132), 4, 4, 16 * 1024)


def test_projection_tiles_only_where_tuned():
    """The decoder's projections leave cuBLAS only for 2..16 rows, at a shape the card's table has; another
    card (the same multiprocessors, no table) keeps cuBLAS."""
    other = tuned.Device("Some_Other_GPU", sms=132, smem=H200_SMEM, capability=(9, 0))
    for (n, k, tile, dtype), cfg in h200_table().items():
        for m in (1, 2, 9, 16, 17, 64):
            got = projection_tiles(H200, m, n, k, torch.bfloat16)
            want = cfg if 1 < m <= PROJECTION_MAX_ROWS and row_tile(m) == tile else None
            assert (None if got is None else dict(got)) == want, (n, k, m)
        assert projection_tiles(other, 4, n, k, torch.bfloat16) is None
    assert projection_tiles(H200, 4, 5120, 5120, torch.bfloat16) is None


def test_linear_projection_dispatch(fake_card, monkeypatch):
    """fast_kernel "stream": one row streams, 2..16 rows take gemv with the tuned tiles, more rows and
    untuned shapes F.linear; every path equals the eager layer."""
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=2)
    fake_card({"gemv": [({"N": 96, "K": 64, "rows": 16, "dtype": "fp32"}, tile)]})
    calls = []
    real_gemv = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(kw["config"]) or real_gemv(*a, **kw))
    torch.manual_seed(0)
    lin = Linear(64, 96).to(DEVICE)
    with torch.no_grad():
        lin.weight.normal_(0, 64 ** -0.5)
    for rows, through_gemv in ((1, False), (2, True), (16, True), (17, False)):
        x = torch.randn(rows, 64, device=DEVICE)
        lin.fast_kernel = None
        eager = lin(x)
        lin.fast_kernel = "stream"
        calls.clear()
        assert rel_err(lin(x), eager) < 1e-5
        assert bool(calls) == through_gemv and all(c["SPLIT_K"] == 2 for c in calls), rows


@pytest.mark.parametrize("rows", [1, 4, 33, MAX_ROWS + 3])
def test_linear_fast_path_equals_eager(rows):
    torch.manual_seed(rows)
    lin = Linear(64, 96).to(DEVICE)
    with torch.no_grad():
        lin.weight.normal_(0, 64 ** -0.5)
    x = torch.randn(rows, 64, device=DEVICE)
    eager = (lin(x), lin(x, out_dtype=torch.float64))
    lin.fast_kernel = "gemv"
    fast = (lin(x), lin(x, out_dtype=torch.float64))
    for f, e in zip(fast, eager):
        assert f.dtype == e.dtype and rel_err(f, e) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 17, 32, 40, 64])
def test_gemv_qwen3_8b_shapes_bf16(m):
    """Every shape of the measured table (and its row tiles) on the GPU, plainly and under PDL, and the
    lm_head's argmax."""
    for n, k in [(151936, 4096), (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]:
        x, w = inputs(m, n, k, torch.bfloat16, seed=m + n)
        ref = gemv_reference(x.double(), w.double())
        assert rel_err(gemv(x, w, out_dtype=torch.float32), ref) < 1e-2
        assert rel_err(gemv(x, w, out_dtype=torch.float32, pdl=True), ref) < 1e-2
        cfg = projection_tiles(tuned.device_spec(x.device), m, n, k, x.dtype)
        if cfg is not None:
            assert rel_err(gemv(x, w, config=cfg, pdl=True), ref) < 1e-2
        if n == 151936:
            assert torch.equal(gemv_argmax(x, w, pdl=True), gemv(x, w, out_dtype=torch.float32).argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [16, 33, 64])
def test_gemv_float32_every_row_tile_on_the_gpu(m):
    """float32 doubles every tile: the defaults are fitted to the device, so the lm_head's 64-row tile (425,984
    bytes at its measured 4 stages) still runs, as does its argmax."""
    for n, k in [(151936, 4096), (4096, 12288)]:
        x, w = inputs(m, n, k, torch.float32, seed=m + n)
        ref = gemv_reference(x.double(), w.double())
        assert rel_err(gemv(x, w), ref) < 1e-5
        if n == 151936:
            assert torch.equal(gemv_argmax(x, w), gemv(x, w).argmax(-1))


@pytest.mark.parametrize("m,n,k,dtype", [(1, 300, 64, torch.float32), (3, 130, 128, torch.float16),
                                         (16, 77, 64, torch.float32), (2, 1000, 96, torch.bfloat16),
                                         (40, 150, 64, torch.float32), (64, 90, 32, torch.float16)])
def test_gemv_argmax_equals_argmax_of_the_logits(m, n, k, dtype):
    """The fused argmax picks what torch.argmax picks from the same kernel's float32 logits, call after call
    (each call re-arms the slots it used)."""
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("Triton's interpreter has no bfloat16 dot")
    for seed in range(3):
        x, w = inputs(m, n, k, dtype, seed=seed)
        got = gemv_argmax(x, w)
        assert got.dtype == torch.int64 and got.shape == (m,)
        assert torch.equal(got, gemv(x, w, out_dtype=torch.float32).argmax(-1))


def test_gemv_argmax_ties_and_negative_logits():
    """Every logit negative, the maximum tied across column blocks and within one: the first index wins, as
    torch.argmax's."""
    x = torch.ones(3, 64, device=DEVICE)
    w = torch.full((200, 64), -1.0, device=DEVICE)
    w[[120, 121, 199]] = -0.5           # 120 and 121 share a block, 199 sits in the last, ragged one
    x[2] = -1.0                         # row 2: every logit positive, the largest at the most negative rows
    w[5] = -3.0
    got = gemv_argmax(x, w)
    assert got.tolist() == gemv(x, w, out_dtype=torch.float32).argmax(-1).tolist() == [120, 120, 5]


def test_gemv_argmax_refuses_more_rows_than_it_has_slots():
    x, w = inputs(MAX_ROWS + 1, 16, 32, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="rows"):
        gemv_argmax(x, w)


def test_cublaslt_rows_by_weight_shape():
    """Qwen3-8B's projections: down_proj (12,288 in, 4,096 out) up to 64 rows, o_proj (square) up to 48,
    qkv and gate_up (wider than deep) never."""
    with torch.device("meta"):
        rows = {name: Linear(k, n).cublaslt_max_rows() for name, (n, k) in
                {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}.items()}
    assert rows == {"qkv": 0, "o_proj": linear_module.SQUARE_CUBLASLT_MAX_ROWS, "gate_up": 0,
                    "down": linear_module.CUBLASLT_MAX_ROWS}


def test_model_sets_cublaslt_rows_only_on_the_fast_path(tiny_model_dir):
    """The model sends down_proj's and o_proj's F.linear through cuBLASLt (the tiny model's o_proj is square
    like Qwen3-8B's), and only on the fast path; on the CPU the layer keeps F.linear whatever it is told."""
    from llmserve_core.layers.attention import get_backend
    from llmserve_core.models.config import ModelConfig
    from llmserve_core.models.loader import load_model
    cfg = ModelConfig.from_hf_dir(tiny_model_dir)
    model = load_model(cfg, tiny_model_dir, "auto", torch.float32, "cpu", get_backend("triton", "cpu"))
    model.set_fused(True)
    layer = model.model.layers[0]
    assert cfg.intermediate_size >= 2 * cfg.hidden_size
    assert cfg.q_size == cfg.hidden_size
    assert layer.mlp.down_proj.cublaslt_rows == linear_module.CUBLASLT_MAX_ROWS
    assert layer.self_attn.o_proj.cublaslt_rows == linear_module.SQUARE_CUBLASLT_MAX_ROWS
    assert layer.mlp.gate_up_proj.cublaslt_rows == layer.self_attn.qkv_proj.cublaslt_rows == 0
    x = torch.randn(3, cfg.intermediate_size)
    down = layer.mlp.down_proj
    torch.testing.assert_close(down(x), torch.nn.functional.linear(x, down.weight), atol=0, rtol=0)
    model.set_fused(False)
    assert down.cublaslt_rows == layer.self_attn.o_proj.cublaslt_rows == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [16, 17, 32, 48, 64, 65])
@pytest.mark.parametrize("n,k", [(4096, 12288), (4096, 4096)])
def test_cublaslt_linear_matches_cublas_and_restores_the_preference(m, n, k):
    """Qwen3-8B's down_proj and o_proj shapes in bf16 with the model's cuBLASLt rows, against cuBLAS (the
    default), and torch's BLAS preference is what it was after the call."""
    before = torch.backends.cuda.preferred_blas_library()
    x, w = inputs(m, n, k, torch.bfloat16, seed=m)
    lin = Linear(k, n).to(device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    ref = torch.nn.functional.linear(x, w)
    lin.cublaslt_rows = lin.cublaslt_max_rows()
    assert rel_err(lin(x), ref) < 1e-2
    assert torch.backends.cuda.preferred_blas_library() == before
