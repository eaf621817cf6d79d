"""The fused-MoE kernels (routing, the pairs' alignment, the decode path, the grouped GEMM, FP8) against
kernels/moe_reference.py on fresh random inputs: in Triton's interpreter on the CPU at tiny shapes, and on a
GPU at Qwen3-30B-A3B's (tests marked gpu)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from helpers.kernels import rel_err
from helpers.tuned import CARD, fake_card  # noqa: F401  (the fixture)
from llmserve_core.kernels import fused_moe as fused_moe_module
from llmserve_core.kernels import tuned
from llmserve_core.kernels.fp8_format import dequantize_weight, quantize_per_block, quantize_per_channel
from llmserve_core.kernels.fp8_quant import quantize_activation_reference
from llmserve_core.kernels.fused_moe import fused_moe, route
from llmserve_core.kernels.moe_align import align, align_reference
from llmserve_core.kernels.moe_reference import fused_moe_reference, route_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def decode_cfg(dot: bool, fused_sum: bool = True, block_n: int = 32, block_k: int = 32) -> dict:
    tile = dict(DOT=dot, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=1)
    return {"path": "decode", "FUSED_SUM": fused_sum, "gate_up": dict(tile), "down": dict(tile, BLOCK_N=2 * block_n)}


def grouped_cfg(block_m: int = 16, block_n: int = 32, block_k: int = 32, group_m: int = 2) -> dict:
    tile = dict(BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=4, num_stages=1)
    return {"path": "grouped", "BLOCK_M": block_m, "gate_up": dict(tile), "down": dict(tile)}


def moe_case(rows, num_experts, top_k, hidden, inter, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    logits = torch.randn(rows, num_experts, generator=gen).to(device)
    weights, ids = route_reference(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def quantize_experts(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [quantize_per_channel(m) if block is None else quantize_per_block(m, block) for m in w.float()]
    return torch.stack([q for q, _ in parts]).to(w.device), torch.stack([s for _, s in parts]).to(w.device)


# ---------------------------------------------------------------- routing

@pytest.mark.parametrize("rows,num_experts,top_k,renormalize,dtype", [
    (1, 8, 2, True, torch.float32), (7, 16, 4, False, torch.float16), (33, 60, 3, True, torch.bfloat16),
    (5, 4, 1, True, torch.float32), (20, 128, 8, True, torch.bfloat16)])
def test_route_matches_reference(rows, num_experts, top_k, renormalize, dtype):
    gen = torch.Generator().manual_seed(rows * num_experts + top_k)
    logits = (torch.randn(rows, num_experts, generator=gen) * 3).to(DEVICE, dtype)
    weights, ids = route(logits, top_k, renormalize)
    ref_w, ref_ids = route_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


def test_route_breaks_ties_lowest_expert_first_as_the_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (24, 16), generator=gen).float()     # many equal logits, ties at the k-th place
    logits[0] = 0.0                                                     # all equal: experts 0..k-1
    logits[1, 5] = logits[1, 9] = 7.0
    for top_k in (1, 4, 8):
        weights, ids = route(logits.to(DEVICE), top_k, True)
        ref_w, ref_ids = route_reference(logits.to(DEVICE), top_k, True)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
        assert ids[0].tolist() == list(range(top_k))
    assert ids[1, :2].tolist() == [5, 9]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")      # the interpreter's NumPy on NaN and inf
def test_route_keeps_ids_in_range_for_nan_and_infinite_logits():
    logits = torch.randn(4, 8)
    logits[0, 3] = float("nan")
    logits[1] = float("-inf")
    logits[2, 2] = float("inf")
    logits[3] = 1e30
    _, ids = route(logits.to(DEVICE), 3, True)
    assert all(sorted(set(row)) == sorted(row) and 0 <= min(row) and max(row) < 8 for row in ids.tolist())
    assert torch.equal(ids, route_reference(logits.to(DEVICE), 3, True)[1])   # NaN probabilities sort first


def test_route_sends_padding_rows_nowhere():
    """Rows past valid_rows (a graph's padding) get ids -1: fused_moe reads no expert for them."""
    x, w13, w2, _, _ = moe_case(4, 8, 2, 32, 16, torch.float32, 4)
    logits = torch.randn(4, 8).to(DEVICE)
    weights, ids = route(logits, 2, True, valid_rows=torch.tensor(2, dtype=torch.int32, device=DEVICE))
    ref_w, ref_ids = route_reference(logits, 2, True)
    assert torch.equal(ids[:2], ref_ids[:2]) and (ids[2:] == -1).all() and (weights[2:] == 0).all()
    out = fused_moe(x, w13, w2, weights, ids, config=PATHS["decode_cuda_cores"])
    assert rel_err(out[:2], fused_moe_reference(x[:2], w13, w2, ref_w[:2], ref_ids[:2])) < 1e-5
    assert (out[2:] == 0).all()


def test_route_names_an_expert_parallel_ranks_experts_locally():
    """experts=(first, count): ids as indices into the rank's share, -1 for another rank's, weights kept;
    padding rows still -1."""
    logits = torch.randn(5, 16).to(DEVICE)
    ref_w, ref_ids = route_reference(logits, 4, True)
    live = torch.tensor(4, dtype=torch.int32, device=DEVICE)
    for first in (0, 4, 12):
        weights, ids = route(logits, 4, True, valid_rows=live, experts=(first, 4))
        local = ref_ids - first
        expected = torch.where((local >= 0) & (local < 4), local, -1)
        assert torch.equal(ids[:4], expected[:4]) and (ids[4] == -1).all()
        torch.testing.assert_close(weights[:4], ref_w[:4], rtol=1e-6, atol=1e-7)


def test_route_rejects_a_top_k_past_the_experts():
    with pytest.raises(ValueError, match="top_k"):
        route(torch.zeros(2, 4, device=DEVICE), 5, True)


# ---------------------------------------------------------------- alignment

@pytest.mark.parametrize("rows,num_experts,top_k,block_m", [(1, 4, 1, 16), (37, 16, 4, 16), (300, 8, 8, 32),
                                                             (5, 128, 8, 64)])
def test_align_lays_pairs_out_as_a_stable_sort(rows, num_experts, top_k, block_m):
    """Many chunks (300 x 8 pairs: 19, two scan steps), experts with no pair or one, and ids outside [0, E)."""
    gen = torch.Generator().manual_seed(rows + num_experts)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(rows)]).int()
    if rows > 1:
        ids[0, 0] = -1                   # an expert another rank holds
    aligned = align(ids.to(DEVICE), num_experts, block_m)
    slots, owners = align_reference(ids, num_experts, block_m)
    assert aligned.sorted_pairs[:len(slots)].tolist() == slots
    assert aligned.block_expert[:len(owners)].tolist() == owners
    assert (aligned.block_expert[len(owners):] == -1).all()


# ---------------------------------------------------------------- fused_moe against the reference

PATHS = {"decode_cuda_cores": decode_cfg(False), "decode_tensor_cores": decode_cfg(True),
         "decode_separate_sum": decode_cfg(False, fused_sum=False), "grouped": grouped_cfg()}


@pytest.mark.parametrize("path,rows,num_experts,top_k,seed", [
    (path, *case) for path in sorted(PATHS) for case in ((1, 4, 1, 0), (3, 16, 4, 1), (8, 8, 2, 2))
    if path != "decode_separate_sum" or case[0] == 3])
def test_decode_and_grouped_paths_match_the_reference(path, rows, num_experts, top_k, seed):
    """Rows that leave experts empty (1 of 16 chosen at one row), with one row, and shared by several rows."""
    x, w13, w2, weights, ids = moe_case(rows, num_experts, top_k, 64, 32, torch.float32, seed)
    out = fused_moe(x, w13, w2, weights, ids, config=PATHS[path])
    assert out.dtype == x.dtype and rel_err(out, fused_moe_reference(x, w13, w2, weights, ids)) < TOL[torch.float32]


@pytest.mark.parametrize("rows,num_experts,top_k,block_m,dtype", [
    (17, 16, 4, 16, torch.float32), (150, 12, 3, 32, torch.float32), (64, 4, 2, 64, torch.float16),
    (40, 16, 1, 16, torch.bfloat16)])
def test_grouped_gemm_matches_the_reference(rows, num_experts, top_k, block_m, dtype):
    x, w13, w2, weights, ids = moe_case(rows, num_experts, top_k, 64, 48, dtype, rows)
    out = fused_moe(x, w13, w2, weights, ids, config=grouped_cfg(block_m))
    assert rel_err(out, fused_moe_reference(x, w13, w2, weights, ids)) < TOL[dtype]


@pytest.mark.parametrize("rows", [2, 6, 16])
def test_decode_rows_on_the_cuda_cores_in_a_small_row_tile(rows):
    """2-16 rows as a [rows] tile of CUDA-core products (the tuner may pick it over the 16-row dot), and
    the 16-row limit of the dedup tile."""
    x, w13, w2, weights, ids = moe_case(rows, 8, 2, 32, 16, torch.float16, rows)
    out = fused_moe(x, w13, w2, weights, ids, config=decode_cfg(False, block_n=16))
    assert rel_err(out, fused_moe_reference(x, w13, w2, weights, ids)) < TOL[torch.float16]


@pytest.mark.parametrize("path", ["decode_cuda_cores", "grouped"])
def test_experts_another_rank_holds_contribute_nothing(path):
    x, w13, w2, weights, ids = moe_case(4, 8, 3, 32, 16, torch.float32, 5)
    ids[0, 1] = -1
    ids[2] = -1                         # a row with no local expert at all
    ids[3, 0] = 8
    out = fused_moe(x, w13, w2, weights, ids, config=PATHS[path])
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    assert rel_err(out, ref) < TOL[torch.float32] and (out[2] == 0).all()


def test_default_configs_take_each_path_by_row_count():
    x, w13, w2, weights, ids = moe_case(12, 8, 2, 32, 16, torch.float32, 7)
    for rows in (1, 5, 12):              # decode on the CUDA cores, on the tensor cores, grouped
        out = fused_moe(x[:rows], w13, w2, weights[:rows], ids[:rows])
        assert rel_err(out, fused_moe_reference(x[:rows], w13, w2, weights[:rows], ids[:rows])) < TOL[torch.float32]
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


@pytest.mark.parametrize("path", ["decode_cuda_cores", "decode_tensor_cores", "grouped"])
def test_two_runs_give_the_same_bits(path):
    x, w13, w2, weights, ids = moe_case(9, 8, 4, 32, 16, torch.float16, 11)
    first = fused_moe(x, w13, w2, weights, ids, config=PATHS[path])
    assert torch.equal(first, fused_moe(x, w13, w2, weights, ids, config=PATHS[path]))


# ---------------------------------------------------------------- FP8

def a8_twin(x, q13, s13, q2, s2, weights, ids, block):
    """The grouped W8A8 GEMM's arithmetic: the reference with each expert's inputs quantized as the kernel
    quantizes its rows (per token, or per 1 x bk piece), then dequantized."""
    group = None if block is None else block[1]

    def requant(t):
        q, s = quantize_activation_reference(t, group)
        return (q.float() * s.repeat_interleave(group or t.shape[1], 1)[:, :t.shape[1]]).to(t.dtype)

    act_q = requant(x)
    total = torch.zeros(x.shape[0], q2.shape[1])
    inter = q13.shape[1] // 2
    for slot in range(ids.shape[1]):
        for t in range(x.shape[0]):
            e = int(ids[t, slot])
            gu = act_q[t:t + 1].float() @ dequantize_weight(q13[e], s13[e], block).t()
            act = requant((F.silu(gu[:, :inter]) * gu[:, inter:]).to(x.dtype))
            y = (act.float() @ dequantize_weight(q2[e], s2[e], block).t()).to(x.dtype)
            total[t] += weights[t, slot] * y[0].float()
    return total.to(x.dtype)


@pytest.mark.parametrize("block", [None, (32, 32)])
@pytest.mark.parametrize("path", ["decode_cuda_cores", "decode_tensor_cores", "grouped"])
def test_fp8_experts_match_the_dequantized_reference(path, block):
    """The decode path widens FP8 weights against the rows as they are: the reference's arithmetic. The grouped
    GEMM quantizes its rows too (W8A8): within e4m3's rounding of the reference, and to float32 rounding of
    the same quantization done in torch."""
    x, w13, w2, weights, ids = moe_case(6, 8, 2, 32, 32, torch.float32, 3)
    q13, s13 = quantize_experts(w13, block)
    q2, s2 = quantize_experts(w2, block)
    out = fused_moe(x, q13, q2, weights, ids, s13, s2, block, config=PATHS[path])
    ref = fused_moe_reference(x, q13, q2, weights, ids, s13, s2, block)
    if path == "grouped":
        assert rel_err(out, ref) < 0.08
        assert rel_err(out, a8_twin(x, q13, s13, q2, s2, weights, ids, block)) < 2e-3
    else:
        assert rel_err(out, ref) < TOL[torch.float32]


# ---------------------------------------------------------------- tables, bad arguments

def test_tables_are_read_by_rows_bucket_with_the_default_elsewhere(fake_card):
    entry, decode = grouped_cfg(32, 64, 64, 4), decode_cfg(True)

    def shape(rows, experts=8):
        return dict(E=experts, N=64, K=32, rows=rows, dtype="fp32")

    def config(rows, experts=8, top_k=2):
        return fused_moe_module.moe_config(rows, experts, 64, 32, top_k, torch.float32, torch.float32, None,
                                           torch.device("cpu"))

    def default(bucket, experts=8, top_k=2):
        return fused_moe_module.default_config(bucket, experts, 4, None, top_k)
    fake_card({"fused_moe": [(shape(4), decode), (shape(512), {"path": "nonsense"})]})
    path = tuned.write_configs("fused_moe", CARD, [(shape(64), entry)], "second sweep")    # merged into the file
    body = json.loads(path.read_text())
    assert body["keys"] == ["E", "N", "K", "rows", "dtype"] and body["sources"] == ["tests", "second sweep"]
    assert config(3) == decode                               # 3 rows: the 4-row bucket
    assert config(33) == entry and config(64) == entry       # 33..64 rows: the 64-row bucket
    assert config(2) == default(2) and config(1000) == default(1024)     # buckets the table does not name
    assert config(400) == default(512)                       # an unusable entry: the default
    assert config(3, experts=16) == default(4, experts=16)   # another shape
    assert config(8, top_k=32) == default(8, top_k=32)       # a decode default past its dedup tile: grouped
    assert config(8, top_k=32)["path"] == "grouped"


def test_a_table_entry_that_does_not_fit_the_call_falls_back():
    usable = fused_moe_module.usable
    assert not usable(decode_cfg(True), 32, 2, None)                 # decode past its row limit
    assert not usable(decode_cfg(True), 16, 16, None)                # or its pairs' dedup tile
    assert not usable(grouped_cfg(16, 32, 256), 64, 2, (128, 128))   # K tile straddles a scale block
    assert not usable(grouped_cfg(16, 33), 64, 2, None)              # gate and up rows unpaired
    assert usable(grouped_cfg(), 64, 2, (128, 128))


@pytest.mark.parametrize("change,field", [
    (lambda a: dict(a, topk_ids=a["topk_ids"].long()), "topk_ids"),
    (lambda a: dict(a, w2=a["w2"][:, :, :8]), "w2"),
    (lambda a: dict(a, topk_weights=a["topk_weights"].half()), "topk_weights"),
    (lambda a: dict(a, w13_scale=torch.ones(4, 32)), "FP8"),
    (lambda a: dict(a, x=a["x"].t()), "x")])
def test_bad_arguments_are_named(change, field):
    x, w13, w2, weights, ids = moe_case(4, 4, 2, 32, 16, torch.float32, 0)
    args = dict(x=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    with pytest.raises(ValueError, match=field):
        fused_moe(**change(args))


def test_fp8_scales_of_the_wrong_shape_are_named():
    x, w13, w2, weights, ids = moe_case(2, 4, 2, 64, 32, torch.float32, 0)
    q13, s13 = quantize_experts(w13, (32, 32))
    q2, s2 = quantize_experts(w2, (32, 32))
    with pytest.raises(ValueError, match="w2_scale"):
        fused_moe(x, q13, q2, weights, ids, s13, s2[:, :1], (32, 32))


# ---------------------------------------------------------------- GPU: Qwen3-30B-A3B's shapes

QWEN3_30B = dict(num_experts=128, top_k=8, hidden=2048, inter=768)
GPU_ROWS = [1, 2, 8, 16, 64, 300, 2048, 8192]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8_channel", "fp8_block"])
def test_gpu_fused_moe_at_qwen3_30b_shapes(kind):
    """bf16 and FP8 (both scale kinds) against the reference, 1 to 8,192 rows, every path the tables pick;
    two runs bit-identical."""
    s = QWEN3_30B
    x, w13, w2, _, _ = moe_case(max(GPU_ROWS), s["num_experts"], s["top_k"], s["hidden"], s["inter"],
                                torch.bfloat16, 0)
    block = (128, 128) if kind == "fp8_block" else None
    scales = (None, None)
    if kind != "bf16":
        (w13, s13), (w2, s2) = quantize_experts(w13, block), quantize_experts(w2, block)
        scales = (s13, s2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for rows in GPU_ROWS:
        logits = torch.randn(rows, s["num_experts"], generator=gen, device="cuda").to(torch.bfloat16)
        weights, ids = route(logits, s["top_k"], True)
        ref_w, ref_ids = route_reference(logits, s["top_k"], True)
        assert torch.equal(ids, ref_ids) and torch.allclose(weights, ref_w, rtol=1e-5, atol=1e-6)
        out = fused_moe(x[:rows], w13, w2, weights, ids, *scales, block)
        ref = fused_moe_reference(x[:rows], w13, w2, weights, ids, *scales, block)
        path = fused_moe_module.moe_config(rows, s["num_experts"], 2 * s["inter"], s["hidden"], s["top_k"],
                                           w13.dtype, torch.bfloat16, block, x.device)["path"]
        tol = 0.08 if kind != "bf16" and path == "grouped" else TOL[torch.bfloat16]     # W8A8 rounds rows to e4m3
        assert rel_err(out, ref) < tol, f"{kind}, {rows} rows"
        assert torch.equal(out, fused_moe(x[:rows], w13, w2, weights, ids, *scales, block)), f"{rows} rows"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8_block"])
def test_gpu_cuda_graphs_replay_the_eager_result(kind):
    s = QWEN3_30B
    x, w13, w2, _, _ = moe_case(256, s["num_experts"], s["top_k"], s["hidden"], s["inter"], torch.bfloat16, 2)
    block = (128, 128) if kind == "fp8_block" else None
    scales = (None, None)
    if kind != "bf16":
        (w13, s13), (w2, s2) = quantize_experts(w13, block), quantize_experts(w2, block)
        scales = (s13, s2)
    for rows in (1, 8, 256):
        logits = torch.randn(rows, s["num_experts"], device="cuda").to(torch.bfloat16)
        xs = x[:rows].clone()

        def step():
            weights, ids = route(logits, s["top_k"], True)
            return fused_moe(xs, w13, w2, weights, ids, *scales, block)
        eager = step()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()                                   # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), f"{kind}, {rows} rows"
        logits.copy_(torch.randn_like(logits))       # new routing: the graph follows it
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, step()), f"{kind}, {rows} rows, rerouted"
