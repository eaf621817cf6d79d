"""The one-row streaming GEMV (the decoder's projections at batch-1 decode) against its torch reference.

On the CPU the kernel runs in Triton's interpreter (which truncates where torch rounds when it casts to
bfloat16: the tolerances allow for that); on the GPU it also runs under PDL, chained in a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels import tuned
from llmserve_core.kernels.stream_gemv import stream_gemv, stream_gemv_reference
from llmserve_core.layers.fp8_linear import Fp8Linear
from llmserve_core.layers.linear import Linear
from helpers.kernels import CUDA, DEVICE, TOL, gemv_inputs, rel_err
from helpers.tuned import fake_card  # noqa: F401  (a fixture)


def inputs(n, k, dtype, seed):
    return gemv_inputs(1, n, k, dtype, seed)


# A tile small enough for the interpreter: several K steps, and N not a multiple of BLOCK_N.
SMALL_TILE = dict(BLOCK_N=8, BLOCK_K=64, num_warps=1, num_stages=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(40, 256), (8, 64), (3, 128)])
def test_stream_gemv_matches_reference(dtype, n, k):
    x, w = inputs(n, k, dtype, seed=n + k)
    for out_dtype in (None, torch.float32):
        y = stream_gemv(x, w, out_dtype=out_dtype, config=SMALL_TILE)
        assert y.shape == (1, n) and y.dtype == (out_dtype or dtype)
        assert rel_err(y, stream_gemv_reference(x.double(), w.double())) < TOL[dtype]


def test_stream_gemv_fp8_weight_with_row_scales():
    x, w = inputs(40, 256, torch.bfloat16, seed=1)
    scale = w.float().abs().amax(1) / 448.0
    q = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
    y = stream_gemv(x, q, scale, config=SMALL_TILE)
    assert rel_err(y, stream_gemv_reference(x, q, scale)) < TOL[torch.bfloat16]
    with pytest.raises(AssertionError, match="scale"):
        stream_gemv(x, q, config=SMALL_TILE)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("n,k", [(40, 256), (40, 128), (8, 64)])
def test_stream_gemv_tiles_in_flight_change_no_value(depth, n, k):
    """Two weight tiles in flight, K as long as the prefetch or shorter: the same output as one ahead."""
    x, w = inputs(n, k, torch.bfloat16, seed=n + depth)
    scale = w.float().abs().amax(1) / 448.0
    q = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
    for weight, s in ((w, None), (q, scale)):
        want = stream_gemv(x, weight, s, config=SMALL_TILE)
        assert torch.equal(stream_gemv(x, weight, s, config=dict(SMALL_TILE, DEPTH=depth)), want)
    with pytest.raises(AssertionError, match="in flight"):
        stream_gemv(x, w, config=dict(SMALL_TILE, DEPTH=3))


@pytest.mark.parametrize("block", [None, (16, 64)])
@pytest.mark.parametrize("n,k", [(40, 256), (8, 64)])
def test_stream_gemv_whole_row_tile(block, n, k):
    """DEPTH 0: a program's rows read whole, as one tile, before the wait: the reference's values (the sum
    runs in another order than the streamed tiles', so within rounding of them); a tile short of K is refused."""
    from llmserve_core.kernels.fp8_format import quantize_per_block
    x, w = inputs(n, k, torch.bfloat16, seed=n + 3)
    if block is None:
        scale = w.float().abs().amax(1) / 448.0
        q = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
    else:
        q, scale = quantize_per_block(w, block)
    whole = dict(SMALL_TILE, BLOCK_K=k, DEPTH=0)
    y = stream_gemv(x, q, scale, block, config=whole)
    assert rel_err(y, stream_gemv_reference(x, q, scale, block)) < TOL[torch.bfloat16]
    assert rel_err(y, stream_gemv(x, q, scale, block, config=SMALL_TILE)) < TOL[torch.bfloat16]
    with pytest.raises(AssertionError, match="one tile of all K"):
        stream_gemv(x, q, scale, block, config=dict(whole, BLOCK_K=k // 2))


@pytest.mark.parametrize("block", [None, (16, 64)])
@pytest.mark.parametrize("pieces", [2, 3, 4])
def test_stream_gemv_whole_rows_in_pieces(block, pieces):
    """DEPTH 0 over K = pieces x BLOCK_K (down_proj's 12,288 = 3 x 4,096): every piece read before the wait,
    the products summed over all of them, equal within rounding to the reference and to a streamed tile; a
    tile whose pieces miss K, or more than four, is refused."""
    from llmserve_core.kernels.fp8_format import quantize_per_block
    k = 64 * pieces
    x, w = inputs(40, k, torch.bfloat16, seed=pieces)
    if block is None:
        scale = w.float().abs().amax(1) / 448.0
        q = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
    else:
        q, scale = quantize_per_block(w, block)
    tile = dict(SMALL_TILE, BLOCK_N=4, BLOCK_K=64, DEPTH=0, PIECES=pieces)
    y = stream_gemv(x, q, scale, block, config=tile)
    assert rel_err(y, stream_gemv_reference(x, q, scale, block)) < TOL[torch.bfloat16]
    assert rel_err(y, stream_gemv(x, q, scale, block, config=SMALL_TILE)) < TOL[torch.bfloat16]
    with pytest.raises(AssertionError, match="one tile of all K"):
        stream_gemv(x, q, scale, block, config=dict(tile, PIECES=pieces - 1))
    x5, w5 = inputs(40, 320, torch.bfloat16, seed=5)
    with pytest.raises(AssertionError, match="one tile of all K"):
        stream_gemv(x5, w5, config=dict(tile, PIECES=5))


@pytest.mark.parametrize("n,k", [(40, 256), (130, 192)])
def test_stream_gemv_fp8_weight_with_block_scales(n, k):
    """128 x 128 scale blocks (Qwen's FP8 checkpoints), with a last block row and column cut short."""
    from llmserve_core.kernels.fp8_format import quantize_per_block
    x, w = inputs(n, k, torch.bfloat16, seed=n)
    q, scale = quantize_per_block(w, (128, 128))
    y = stream_gemv(x, q, scale, (128, 128), config=SMALL_TILE)
    assert rel_err(y, stream_gemv_reference(x, q, scale, (128, 128))) < TOL[torch.bfloat16]
    with pytest.raises(AssertionError, match="split"):
        stream_gemv(x, q, scale, (4, 128), config=SMALL_TILE)


@pytest.mark.parametrize("weight", ["16-bit", "fp8 rows", "fp8 whole rows", "fp8 whole rows in pieces",
                                    "fp8 whole rows, blocks"])
@pytest.mark.parametrize("n", [80, 48])
def test_stream_gemv_ends_in_the_silu_mul(weight, n):
    """silu_mul: over a packed [gate | up] weight (48 = 2 x 24: the last program's columns cut short, the up
    rows starting mid scale block), the SiLU-and-mul of the products, against the reference's products in
    float64 (the kernel rounds once, the unfolded chain twice). Block scales take whole rows only (each row
    weighs its sums per scale block by its own block row); a streamed tile over them is refused."""
    from llmserve_core.kernels.fp8_format import quantize_per_block
    from llmserve_core.kernels.silu_mul import silu_mul_reference
    k = 256
    x, w = inputs(n, k, torch.bfloat16, seed=n + 5)
    scale, block = None, None
    config = dict(SMALL_TILE, DEPTH=2)
    if weight.startswith("fp8"):
        if weight.endswith("blocks"):
            block = (16, 64)
            w, scale = quantize_per_block(w, block)
        else:
            scale = w.float().abs().amax(1) / 448.0
            w = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
        config = dict(SMALL_TILE, BLOCK_K=k, DEPTH=0) if "whole" in weight else SMALL_TILE
        if "pieces" in weight:
            config = dict(SMALL_TILE, BLOCK_K=k // 4, DEPTH=0, PIECES=4)
    y = stream_gemv(x, w, scale, block, config=config, silu_mul=True)
    assert y.shape == (1, n // 2) and y.dtype == torch.bfloat16
    products = stream_gemv_reference(x.double(), w.double() if scale is None else w, scale, block,
                                     out_dtype=torch.float64)
    assert rel_err(y, silu_mul_reference(products)) < TOL[torch.bfloat16]
    if block is not None:         # a streamed tile, or whole rows in pieces, refused over block scales
        for tile in (SMALL_TILE, dict(SMALL_TILE, BLOCK_K=k // 4, DEPTH=0, PIECES=4)):
            with pytest.raises(AssertionError, match="silu_mul"):
                stream_gemv(x, w, scale, block, config=tile, silu_mul=True)


def rule(n: int, k: int, dtype: str = "bf16", scale: str = "none", sms: int = 132):
    """The stream tile's heuristic: its answer on a card no table names."""
    return tuned.lookup("stream_gemv", tuned.Device("Untuned_Card", sms=sms), N=n, K=k, dtype=dtype, scale=scale)


def test_heuristic_keeps_one_wave_and_refuses_a_k_no_tile_divides():
    assert rule(4096, 4096) == dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=1, DEPTH=2)
    for n, k in ((6144, 4096), (24576, 4096), (4096, 12288)):     # 16-bit weights: one tile for every shape
        assert rule(n, k) == rule(4096, 4096) == rule(n, k, "fp16")
    # FP8 rows of up to 4096 columns (a power of two): each program's rows whole, one tile
    whole = dict(BLOCK_N=8, BLOCK_K=4096, num_warps=8, num_stages=1, DEPTH=0, PIECES=1)
    for n in (4096, 6144, 24576):
        assert rule(n, 4096, "fp8", "channel") == whole
    assert rule(4096, 1024, "fp8", "channel")["BLOCK_K"] == 1024
    # longer FP8 rows that up to 4 power-of-two tiles make up: whole too, over fewer rows (48 KB a program at most)
    assert rule(4096, 12288, "fp8", "channel") == dict(whole, BLOCK_N=4, PIECES=3)
    assert rule(4096, 8192, "fp8", "channel") == dict(whole, BLOCK_N=4, PIECES=2)
    assert rule(4096, 3072, "fp8", "channel") == dict(whole, BLOCK_K=1024, PIECES=3)
    # ... with row scales: under 128 x 128 block scales only rows of one piece are read whole
    assert rule(4096, 4096, "fp8", "128x128") == whole
    assert rule(4096, 12288, "fp8", "128x128")["DEPTH"] == 1
    # others (and float32 weights): one tile ahead, narrower where programs overfill a wave
    assert rule(4096, 9728, "fp8", "channel") == dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, num_stages=1, DEPTH=1)
    assert rule(6144, 4096, "fp32")["BLOCK_K"] == 256     # 768 programs: more than 4 per SM
    assert rule(6144, 4096, "fp32", sms=192)["BLOCK_K"] == 512
    assert rule(4096, 12288, "fp32")["num_warps"] == 8
    assert rule(64, 192)["BLOCK_K"] == 64
    assert rule(64, 96) is None and rule(64, 100) is None
    x, w = inputs(64, 96, torch.bfloat16, seed=0)
    with pytest.raises(AssertionError, match=r"no tile for a \[64, 96\] weight"):
        stream_gemv(x, w)


@torch.no_grad()
def test_linear_streams_one_row_and_falls_back_for_more():
    """fast_kernel "stream": one row through the kernel, two rows and an awkward K through F.linear."""
    torch.manual_seed(0)
    for in_features, rows in ((128, 1), (64, 2), (100, 1)):
        lin = Linear(in_features, 40).to(DEVICE)
        lin.weight.normal_(0, in_features ** -0.5)
        x = torch.randn(rows, in_features, device=DEVICE)
        eager = lin(x)
        lin.fast_kernel = "stream"
        assert rel_err(lin(x), eager) < 1e-5 and rel_err(lin(x, out_dtype=torch.float64), eager) < 1e-5


@torch.no_grad()
def test_linear_folds_the_silu_mul_into_one_streamed_row_only():
    """A packed [gate | up] Linear on the stream chain ends one row in the SiLU-and-mul (the unfolded
    chain's value); two rows, an awkward K and the eager path say they cannot, and are refused."""
    from llmserve_core.layers.activation import silu_and_mul
    torch.manual_seed(1)
    lin = Linear(128, 48).to(DEVICE)
    lin.weight.normal_(0, 128 ** -0.5)
    x = torch.randn(2, 128, device=DEVICE)
    assert not lin.folds_silu_mul(1)
    lin.fast_kernel = "stream"
    assert lin.folds_silu_mul(1) and not lin.folds_silu_mul(2)
    assert rel_err(lin(x[:1], silu_mul=True), silu_and_mul(lin(x[:1]))) < 1e-5
    with pytest.raises(AssertionError, match="silu_mul"):
        lin(x, silu_mul=True)
    awkward = Linear(100, 48)             # no stream tile divides K
    awkward.fast_kernel = "stream"
    assert not awkward.folds_silu_mul(1)


@pytest.mark.parametrize("block", [None, (128, 128)])
@torch.no_grad()
def test_fp8_linear_takes_the_kernel_its_table_names(block, monkeypatch, fake_card):
    """On a card whose table (faked here) gives one row of a shape the stream kernel, that row streams on
    the decode chain, and the W8A8 kernel's rows take the table's tile elsewhere; off the chain, or where
    the table names nothing, the heuristic applies."""
    import llmserve_core.kernels.stream_gemv as stream
    from llmserve_core.kernels.fp8_gemv import fp8_gemv_a8_reference
    calls = []
    monkeypatch.setattr(stream, "stream_gemv", lambda *a, **kw: calls.append(1) or stream_gemv(*a, **kw))
    scale = tuned.scale_key(block)
    a8 = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=1)
    a8_tol = 5e-4 if CUDA else 1e-5     # Hopper sums FP8 products in fewer bits than float32 (test_fp8_kernels)
    shape = {"N": 136, "K": 256, "scale": scale, "x": "raw"}
    fake_card({"fp8_gemv": [(dict(shape, rows=1), {"kernel": "stream"}),
                            (dict(shape, rows=4), {"kernel": "a8", "tile": a8})]})
    torch.manual_seed(0)
    lin = Fp8Linear(256, 136, block).to_empty(device=DEVICE)
    lin.quantize_rows_(torch.randn(136, 256) / 16)
    x = torch.randn(3, 256, device=DEVICE)
    want = lin(x)           # off the fast path: the dequantized reference
    lin.fused, lin.fast_kernel = True, "stream"
    assert rel_err(lin(x[:1]), want[:1]) < 1e-5 and calls == [1]
    got = lin(x)                                        # 2-4 rows: the W8A8 kernel, x quantized per 64 columns
    assert calls == [1] and rel_err(got, fp8_gemv_a8_reference(x, lin.weight, lin.weight_scale, block, 64)) < a8_tol
    assert rel_err(got, want) < 4e-2
    lin.fast_kernel = None                              # off the chain: no stream kernel, the rule's a8 tiles
    assert rel_err(lin(x[:1]), fp8_gemv_a8_reference(x[:1], lin.weight, lin.weight_scale, block, 128)) < a8_tol
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs PDL (Hopper or later)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stream_gemv_qwen3_8b_shapes_under_pdl_in_a_graph(dtype):
    """The decoder's projections back to back, each reading the one before's output, launched under PDL
    and replayed from a CUDA graph: equal to the same chain launched plainly, and to the reference."""
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    ws = [inputs(n, k, dtype, seed=n + k)[1] for n, k in shapes]
    x0 = inputs(8, 4096, dtype, seed=0)[0]

    def chain(gemv):
        x = x0
        for w in ws:    # each projection reads the one before's output, cut or tiled to its K
            k = w.shape[1]
            x = gemv(x.repeat(1, -(-k // x.shape[1]))[:, :k].contiguous(), w)
        return x

    plain = chain(stream_gemv)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(lambda x, w: stream_gemv(x, w, pdl=True))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, plain)
    assert rel_err(plain, chain(stream_gemv_reference)) < 10 * TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs PDL (Hopper or later)")
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_stream_gemv_fp8_qwen3_8b_shapes_under_pdl_in_a_graph(block):
    """Each projection, and gate_up ending in the SiLU-and-mul, under PDL in a graph: equal to plain launches."""
    from llmserve_core.kernels.fp8_format import quantize_per_block, quantize_per_channel
    from llmserve_core.kernels.silu_mul import silu_mul_reference
    for n, k, silu_mul in [(6144, 4096, False), (4096, 4096, False), (24576, 4096, False), (24576, 4096, True),
                           (4096, 12288, False)]:
        x, w = inputs(n, k, torch.bfloat16, seed=n + k)
        q, scale = quantize_per_channel(w) if block is None else quantize_per_block(w, block)
        plain = stream_gemv(x, q, scale, block, silu_mul=silu_mul)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = stream_gemv(x, q, scale, block, pdl=True, silu_mul=silu_mul)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, plain)
        want = stream_gemv_reference(x, q, scale, block, out_dtype=torch.float32)
        assert rel_err(plain, silu_mul_reference(want) if silu_mul else want) < TOL[torch.bfloat16]
