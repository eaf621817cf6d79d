"""benchmarks/floor.py: the bytes and FLOPs every benchmark's floor is built from."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from floor import StepShape, decode_floor, kv_bytes_per_token, moe_step_bytes, moe_step_floor, prompts_floor, \
    step_bytes, step_flops, step_floor, step_weight_bytes  # noqa: E402
from qwen3_8b import QWEN3_8B_CONFIG  # noqa: E402
from qwen3_moe import QWEN3_30B_A3B_CONFIG  # noqa: E402

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def test_weight_bytes_are_the_model_without_its_embedding_table():
    """Counted against transformers' own Qwen3 (untied): every parameter but the embedding table."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL, tie_word_embeddings=False))
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert step_weight_bytes(SMALL, dtype_bytes=2) == 2 * params


def test_qwen3_8b_batch1_floor_is_the_issue_arithmetic():
    # 36 layers + final norm + lm_head = 15.14 GB in bf16; 147,456 KV bytes per token.
    assert step_weight_bytes(QWEN3_8B_CONFIG) == pytest.approx(15.137e9, rel=1e-4)
    assert kv_bytes_per_token(QWEN3_8B_CONFIG) == 147456
    floor = decode_floor(QWEN3_8B_CONFIG, [640], 4.26e12, 790e12)
    assert floor.bound == "memory" and floor.ms == pytest.approx(3.575, abs=0.005)


def test_bytes_count_one_embedding_row_per_token_and_the_kv():
    one = step_bytes(SMALL, StepShape(decode_contexts=(10,)))
    two = step_bytes(SMALL, StepShape(decode_contexts=(10, 30)))
    row, kv = SMALL["hidden_size"] * 2, kv_bytes_per_token(SMALL)
    assert one == step_weight_bytes(SMALL) + row + kv * (10 + 1)
    assert two - one == row + kv * (30 + 1)


def test_fp8_counts_a_byte_a_projection_weight_and_its_row_scales():
    """FP8 projections (per-channel scales, as --quantization fp8 stores them) and an FP8 KV cache: counted
    against transformers' parameters, the linears at one byte plus a float32 per output row."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL, tie_word_embeddings=False))
    linears = [m for n, m in model.named_modules() if n.endswith("_proj")]
    linear_params = sum(m.weight.numel() for m in linears)
    rows = sum(m.weight.shape[0] for m in linears)
    others = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) - linear_params
    assert step_weight_bytes(SMALL, 2, linear_bytes=1) == linear_params + 4 * rows + 2 * others
    assert step_weight_bytes(SMALL, 2, linear_bytes=2) == step_weight_bytes(SMALL, 2)
    shape = StepShape(decode_contexts=(10,))
    assert step_bytes(SMALL, shape, 2, kv_dtype_bytes=1) == step_bytes(SMALL, shape) - kv_bytes_per_token(SMALL) // 2 * 11
    # Qwen3-8B at 612 tokens of context: a batch-1 step reads 1.84x fewer bytes with FP8 projections.
    ratio = decode_floor(QWEN3_8B_CONFIG, [612], 4.25e12, 790e12).ms / decode_floor(
        QWEN3_8B_CONFIG, [612], 4.25e12, 790e12, linear_bytes=1).ms
    assert ratio == pytest.approx(1.84, abs=0.01)


def test_flops_count_linears_lm_head_and_causal_attention():
    c = SMALL
    linear_per_token = 2 * c["num_hidden_layers"] * (c["hidden_size"] * (64 + 2 * 32) + 64 * 64
                                                      + 3 * 64 * c["intermediate_size"])
    lm_head = 2 * c["vocab_size"] * c["hidden_size"]
    attn_pair = 4 * c["num_attention_heads"] * c["head_dim"] * c["num_hidden_layers"]
    assert step_flops(c, StepShape(decode_contexts=(7,))) == linear_per_token + lm_head + attn_pair * 7
    # A chunk of 4 new tokens over 5 cached ones: 5*4 + (1+2+3+4) key pairs; it samples nothing here.
    chunk = StepShape(prefill_chunks=((5, 4),))
    assert step_flops(c, chunk) == 4 * linear_per_token + attn_pair * (20 + 10)
    assert step_flops(c, StepShape(prefill_chunks=((5, 4),), sampled_chunks=1)) == step_flops(c, chunk) + lm_head


def test_a_big_prefill_chunk_makes_the_step_compute_bound():
    decode = decode_floor(QWEN3_8B_CONFIG, [640] * 64, 4.26e12, 790e12)
    assert decode.bound == "memory"
    mixed = step_floor(QWEN3_8B_CONFIG, StepShape((640,) * 64, ((0, 2048),), 1), 4.26e12, 790e12)
    assert mixed.bound == "compute" and mixed.ms == mixed.compute_ms > decode.ms


@pytest.mark.parametrize("bw,peak", [(0, 1e12), (1e12, 0), (-1.0, 1e12)])
def test_rates_must_be_positive(bw, peak):
    with pytest.raises(ValueError, match="bandwidth and peak_flops"):
        decode_floor(SMALL, [1], bw, peak)


def test_profile_summary_counts_per_call_and_merges_overlaps():
    """kernel_trace.summarize, which decode_profile and spec_timing --profile report from."""
    from kernel_trace import summarize
    kernels = [("nvjet_sm90_gemm", 0.0, 10.0), ("_decode_kernel", 5.0, 10.0), ("_rmsnorm_kernel", 30.0, 2.0),
               ("nvjet_sm90_gemm", 40.0, 10.0)]
    s = summarize(kernels, calls=2)
    assert s["kernels_per_step"] == 2
    assert s["gpu_ms_by_kind"] == {"gemm": 0.01, "attention": 0.005, "other": 0.001}
    assert s["busy_ms_per_step"] == pytest.approx((15 + 2 + 10) / 2 / 1e3)       # 0-15 overlaps, then 2, then 10
    assert s["idle_fraction"] == pytest.approx(1 - 27 / 50)                      # the span is 0-50
    # The decode kernel starts inside the GEMM: only its 5 us past the GEMM's end are its own.
    assert s["kernels"][0] == {"name": "nvjet_sm90_gemm", "calls": 1.0, "us": 10.0, "frontier_us": 10.0}
    assert s["kernels"][1]["frontier_us"] == pytest.approx(2.5)
    assert [k["name"] for k in s["kernels"]] == ["nvjet_sm90_gemm", "_decode_kernel", "_rmsnorm_kernel"]


def test_frontier_time_splits_the_busy_time_among_the_kernels():
    from kernel_trace import busy_us, frontier_us
    # b starts under a and ends after it (a PDL wait), c lies inside b, d follows a gap.
    kernels = [("a", 0.0, 10.0), ("b", 4.0, 9.0), ("c", 6.0, 2.0), ("d", 20.0, 3.0)]
    assert frontier_us(kernels) == pytest.approx([10.0, 3.0, 0.0, 3.0])
    assert sum(frontier_us(kernels)) == pytest.approx(busy_us(kernels))


def test_idle_gaps_are_named_by_the_kernel_that_ended_last_and_the_one_after():
    from kernel_trace import busy_us, idle_gaps, span_us
    # b ends after a (so b ended last before the first gap), c is nested in b; then two steps' gaps.
    kernels = [("a", 0.0, 10.0), ("b", 4.0, 9.0), ("c", 5.0, 2.0), ("copy", 16.0, 1.0), ("a", 20.0, 10.0),
               ("b", 24.0, 9.0), ("copy", 35.0, 1.0), ("a", 40.0, 2.0)]
    gaps = idle_gaps(kernels, calls=2)
    assert gaps == [{"after": "copy", "before": "a", "count": 1.0, "us": pytest.approx(3.5)},
                    {"after": "b", "before": "copy", "count": 1.0, "us": pytest.approx(2.5)}]
    assert sum(g["us"] * 2 for g in gaps) == pytest.approx(span_us(kernels) - busy_us(kernels))


def test_busy_time_is_the_union_of_intervals_in_any_order():
    from kernel_trace import busy_us, span_us
    # Nested, touching and disjoint intervals, given out of order (as a filter by kind leaves them).
    kernels = [("c", 20.0, 5.0), ("a", 0.0, 10.0), ("b", 2.0, 3.0), ("d", 10.0, 4.0), ("e", 24.0, 6.0)]
    assert busy_us(kernels) == pytest.approx(14 + 10)          # 0-14, then 20-30
    assert span_us(kernels) == pytest.approx(30)
    assert busy_us([]) == 0.0 and span_us([]) == 0.0


@pytest.mark.parametrize("name,kind", [
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"), ("_gemv_kernel", "gemm"), ("_w8a8_kernel", "gemm"),
    ("_fp8_gemv_fma_kernel", "gemm"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
    ("void cutlass::device_kernel<flash::FlashAttnFwdSm90>", "attention"),     # a CUTLASS kernel, but attention
    ("_decode_kernel", "attention"), ("_prefill_kernel", "attention"), ("fmha_cutlassF", "attention"),
    ("_rmsnorm_kernel", "other"), ("Memcpy HtoD (Pinned -> Device)", "other")])
def test_kernel_kinds(name, kind):
    from kernel_trace import kernel_kind
    assert kernel_kind(name) == kind


def test_a_pooling_prompt_costs_its_prefill_and_no_head():
    """An embedding model's prompts: the layers and causal attention over each, no lm_head at all; a score
    adds its named rows only. 512-token documents on the 8B shape are compute-bound at any real budget."""
    one = prompts_floor(SMALL, [10], 16, 1e12, 1e14)
    assert one.flops == step_flops(SMALL, StepShape(prefill_chunks=((0, 10),)))
    headless = prompts_floor(SMALL, [10], 16, 1e12, 1e14, lm_head=False)
    assert one.bytes - headless.bytes == 2 * SMALL["vocab_size"] * SMALL["hidden_size"]
    scored = prompts_floor(SMALL, [10], 16, 1e12, 1e14, head_rows=2)
    assert scored.flops - one.flops == 2 * 2 * SMALL["hidden_size"]
    assert prompts_floor(SMALL, [10, 10], 16, 1e12, 1e14).bytes == 2 * one.bytes      # two steps of weights
    docs = prompts_floor(QWEN3_8B_CONFIG, [512] * 32, 16384, 3.3e12, 700e12, lm_head=False)
    assert docs.bound == "compute"
    # ~2 x 6.95e9 multiply-adds a token in the linears, plus causal attention over 512 tokens.
    assert docs.flops / (32 * 512) == pytest.approx(2 * 6.95e9 + 36 * 4 * 32 * 128 * 256.5, rel=0.01)


def test_moe_floor_reads_the_selected_experts():
    """Qwen3-30B-A3B's batch-1 decode reads about 6.1 GB in bf16 (the issue's figure): every layer's attention,
    router and norms, 8 experts a layer, the lm_head; against transformers' parameter count of a small MoE,
    all experts read is every parameter but the embedding table."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    one = StepShape(decode_contexts=(1,))
    c = QWEN3_30B_A3B_CONFIG
    layers = c["num_hidden_layers"]
    kv = kv_bytes_per_token(c)
    assert moe_step_bytes(c, one, 8 * layers) - 2 * c["hidden_size"] - 2 * kv == pytest.approx(6.084e9, rel=1e-3)
    small = dict(SMALL, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**small, tie_word_embeddings=False))
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    empty = StepShape()
    assert moe_step_bytes(small, empty, 8 * 2) == 2 * params
    # FP8: one byte a projection or expert weight and a float32 scale per output row; the rest stays 2 bytes
    fp8 = moe_step_bytes(small, empty, 8 * 2, linear_bytes=1)
    attention, experts = 2 * (64 * (64 + 2 * 32) + 64 * 64), 16 * 3 * 64 * 32     # 2 layers, 8 experts each
    scale_rows = 2 * ((64 + 2 * 32) + 64) + 16 * (2 * 32 + 64)
    assert fp8 == 2 * params - attention - experts + 4 * scale_rows
    f = moe_step_floor(c, one, 8 * layers, 3.0e12, 800e12)
    assert f.bound == "memory" and f.ms == pytest.approx(f.bytes / 3.0e9)
    prefill = moe_step_floor(c, StepShape(prefill_chunks=((0, 4096),), sampled_chunks=1), 128 * layers, 3.0e12,
                             800e12, linear_peak=1600e12)
    assert prefill.bound == "compute" and prefill.compute_ms < prefill.flops / 800e12 * 1e3
