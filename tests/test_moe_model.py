"""Qwen3MoeForCausalLM against transformers' own Qwen3MoeForCausalLM, float32 on CPU, and the MoE torch
references (kernels/moe_reference.py) against transformers' router and experts.

The tiny configs are unseen shapes: 8 to 16 experts, top-1 to top-4, norm_topk_prob on and off, dense layers
mixed in through mlp_only_layers and decoder_sparse_step.
"""
import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3Moe
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from helpers.batch import allocate_tables, make_batch, make_kv_caches, prefill_then_decodes
from llmserve_core.kernels.fp8_format import dequantize_weight, quantize_per_block, quantize_per_channel
from llmserve_core.kernels.moe_reference import fused_moe_reference, route_reference
from llmserve_core.layers.attention import get_backend
from llmserve_core.layers.moe import SparseMoeBlock
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.loader import load_model
from llmserve_core.models.qwen3 import Qwen3MLP
from llmserve_core.models.qwen3_moe import Qwen3MoeForCausalLM

MOE_CONFIGS = {
    # Top-1 over 8 experts, renormalised (a lone weight of one), every layer sparse, tied embeddings.
    "e8-top1-norm": dict(num_experts=8, num_experts_per_tok=1, norm_topk_prob=True, num_hidden_layers=2),
    # Top-3 over 12, raw softmax weights, layer 1 dense (mlp_only_layers), separate lm_head.
    "e12-top3-raw-mlp-only": dict(num_experts=12, num_experts_per_tok=3, norm_topk_prob=False, num_hidden_layers=3,
                                  mlp_only_layers=[1], tie_word_embeddings=False, moe_intermediate_size=24),
    # Top-4 over 16, every second layer sparse (decoder_sparse_step 2: layers 1 and 3), GQA 4, yarn.
    "e16-top4-step2": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=4,
                           decoder_sparse_step=2, num_attention_heads=8, num_key_value_heads=2,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
}
PROMPT_LENS = [1, 7, 23, 16, 5]
BLOCK_SIZE = 4
BACKEND = get_backend("torch", "cpu")


def random_prompts(vocab, lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def case(request, make_random_qwen3_dir):
    path = make_random_qwen3_dir(seed=5, moe=True, initializer_range=0.1, **MOE_CONFIGS[request.param])
    cfg = ModelConfig.from_hf_dir(path)
    ours = load_model(cfg, path, "auto", torch.float32, "cpu", BACKEND)
    hf = HFQwen3Moe.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(cfg.vocab_size, PROMPT_LENS, seed=11)
    with torch.no_grad():
        ref = [hf(p[None], output_hidden_states=True) for p in prompts]
    return cfg, ours, hf, prompts, ref


def test_the_model_has_its_configs_sparse_and_dense_layers(case):
    cfg, model, hf, _, _ = case
    assert isinstance(model, Qwen3MoeForCausalLM)
    for i, (ours, theirs) in enumerate(zip(model.model.layers, hf.model.layers)):
        sparse = type(theirs.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
        assert cfg.is_sparse_layer(i) == sparse
        assert isinstance(ours.mlp, SparseMoeBlock if sparse else Qwen3MLP)
        if sparse:   # the stacked weights hold transformers' own (gate rows then up rows)
            torch.testing.assert_close(ours.mlp.w13, theirs.mlp.experts.gate_up_proj, atol=0, rtol=0)
            torch.testing.assert_close(ours.mlp.w2, theirs.mlp.experts.down_proj, atol=0, rtol=0)
            torch.testing.assert_close(ours.mlp.gate.weight, theirs.mlp.gate.weight, atol=0, rtol=0)
    assert any(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))


@torch.no_grad()
def test_packed_prefill_then_cached_extend_match_transformers(case):
    """Mixed-length prompts in one packed prefill over interleaved blocks, then 3 more tokens each read
    against the cached KV: every logit row as transformers' full-sequence forward."""
    cfg, model, hf, prompts, ref = case
    extra = random_prompts(cfg.vocab_size, [3] * len(PROMPT_LENS), seed=12)
    tables, num_blocks = allocate_tables([n + 3 for n in PROMPT_LENS], BLOCK_SIZE)
    kv = make_kv_caches(cfg, num_blocks, BLOCK_SIZE)
    logits = model.compute_logits(model(torch.cat(prompts), make_batch([(0, n) for n in PROMPT_LENS], tables,
                                                                       BLOCK_SIZE), kv))
    assert ref[2].logits.std() > 0.5      # far from uniform, or argmax agreement would prove nothing
    for rows, r in zip(logits.split(PROMPT_LENS), ref):
        torch.testing.assert_close(rows, r.logits[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(rows.argmax(-1), r.logits[0].argmax(-1))
    logits = model.compute_logits(model(torch.cat(extra), make_batch([(n, 3) for n in PROMPT_LENS], tables,
                                                                      BLOCK_SIZE), kv))
    for rows, p, e in zip(logits.split(3), prompts, extra):
        want = hf(torch.cat([p, e])[None]).logits[0, -3:]
        torch.testing.assert_close(rows, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(rows.argmax(-1), want.argmax(-1))


@torch.no_grad()
def test_aux_hidden_states_are_the_layer_inputs(case):
    """EAGLE-3's aux state for layer i is the residual stream entering it, as for dense Qwen3."""
    cfg, model, _, prompts, ref = case
    tables, num_blocks = allocate_tables(PROMPT_LENS, BLOCK_SIZE)
    batch = make_batch([(0, n) for n in PROMPT_LENS], tables, BLOCK_SIZE)
    layer_ids = (cfg.num_hidden_layers - 1, 0, 1)
    _, aux = model(torch.cat(prompts), batch, make_kv_caches(cfg, num_blocks, BLOCK_SIZE), aux_layer_ids=layer_ids)
    for layer, got in zip(layer_ids, aux):
        torch.testing.assert_close(got, torch.cat([r.hidden_states[layer][0] for r in ref]), atol=1e-5, rtol=1e-5)


# ---- the references against transformers' router and experts ------------------------------------------

def _hf_moe_config(experts, top_k, norm, hidden=48, inter=20):
    return Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                          num_experts_per_tok=top_k, norm_topk_prob=norm)


@pytest.mark.parametrize("experts,top_k,norm", [(8, 1, True), (10, 3, False), (16, 4, True), (9, 9, False)])
def test_route_reference_is_transformers_router(experts, top_k, norm):
    torch.manual_seed(experts + top_k)
    router = Qwen3MoeTopKRouter(_hf_moe_config(experts, top_k, norm))
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(37, router.hidden_dim)
    logits, want_w, want_ids = router(x)
    weights, ids = route_reference(logits, top_k, norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (37, top_k)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w.float(), atol=0, rtol=0)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37), atol=1e-6, rtol=0)


def test_route_reference_takes_equal_probabilities_lowest_expert_first():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 1.0, 3.0, 1.0]])
    weights, ids = route_reference(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1], [1, 3]]
    assert weights[1].tolist() == [0.5, 0.5]


@pytest.mark.parametrize("experts,top_k", [(8, 2), (12, 4), (16, 1)])
def test_fused_moe_reference_is_transformers_experts(experts, top_k):
    torch.manual_seed(experts)
    cfg = _hf_moe_config(experts, top_k, True)
    hf = Qwen3MoeExperts(cfg)
    torch.nn.init.normal_(hf.gate_up_proj, std=0.2)
    torch.nn.init.normal_(hf.down_proj, std=0.2)
    x = torch.randn(29, cfg.hidden_size)
    weights, ids = route_reference(torch.randn(29, experts), top_k, True)
    got = fused_moe_reference(x, hf.gate_up_proj.data, hf.down_proj.data, weights, ids)
    want = hf(x, ids.long(), weights)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert fused_moe_reference(x[:0], hf.gate_up_proj.data, hf.down_proj.data, weights[:0], ids[:0]).shape == (0, 48)


def test_fused_moe_reference_skips_ids_another_rank_holds():
    """Expert parallelism masks the experts a rank does not hold with id -1: they add nothing."""
    torch.manual_seed(0)
    w13, w2 = torch.randn(4, 16, 12), torch.randn(4, 12, 8)
    x = torch.randn(6, 12)
    weights, ids = route_reference(torch.randn(6, 4), 2, False)
    full = fused_moe_reference(x, w13, w2, weights, ids)
    only_first = torch.where(ids == 0, ids, -1)
    first = fused_moe_reference(x, w13, w2, weights, only_first)
    rest = fused_moe_reference(x, w13, w2, weights, torch.where(ids == 0, -1, ids))
    torch.testing.assert_close(first + rest, full, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused_moe_reference(x, w13, w2, weights, torch.full_like(ids, -1)), torch.zeros(6, 12))


@pytest.mark.parametrize("block", [None, (8, 4)])
def test_fp8_reference_computes_with_the_dequantized_experts(block):
    torch.manual_seed(1)
    E, inter, hidden = 6, 8, 12
    w13, w2 = torch.randn(E, 2 * inter, hidden), torch.randn(E, hidden, inter)
    q = [quantize_per_channel(w) if block is None else quantize_per_block(w, block) for w in (*w13, *w2)]
    q13, s13 = torch.stack([a for a, _ in q[:E]]), torch.stack([s for _, s in q[:E]])
    q2, s2 = torch.stack([a for a, _ in q[E:]]), torch.stack([s for _, s in q[E:]])
    deq13 = torch.stack([dequantize_weight(a, s, block) for a, s in zip(q13, s13)])
    deq2 = torch.stack([dequantize_weight(a, s, block) for a, s in zip(q2, s2)])
    x = torch.randn(9, hidden)
    weights, ids = route_reference(torch.randn(9, E), 3, True)
    got = fused_moe_reference(x, q13, q2, weights, ids, s13, s2, block)
    torch.testing.assert_close(got, fused_moe_reference(x, deq13, deq2, weights, ids), atol=0, rtol=0)
    # and FP8 is close to the unquantized experts, not something else
    exact = fused_moe_reference(x, w13, w2, weights, ids)
    assert (got - exact).norm() < 0.1 * exact.norm()


@torch.no_grad()
def test_bfloat16_runs_close_to_float32(make_random_qwen3_dir):
    path = make_random_qwen3_dir(seed=5, moe=True, initializer_range=0.1, **MOE_CONFIGS["e8-top1-norm"])
    cfg = ModelConfig.from_hf_dir(path)
    f32 = load_model(cfg, path, "auto", torch.float32, "cpu", BACKEND)
    bf16 = load_model(cfg, path, "auto", torch.bfloat16, "cpu", BACKEND)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    ids = random_prompts(cfg.vocab_size, [12], seed=0)[0]
    batch = make_batch([(0, 12)], [[1, 2, 3]], BLOCK_SIZE)
    a = f32.compute_logits(f32(ids, batch, make_kv_caches(cfg, 4, BLOCK_SIZE)))
    b = bf16.compute_logits(bf16(ids, batch, make_kv_caches(cfg, 4, BLOCK_SIZE, dtype=torch.bfloat16)))
    torch.testing.assert_close(b, a, atol=0.1, rtol=0.1)


@torch.no_grad()
def test_fused_path_matches_the_eager_model(make_random_qwen3_dir):
    """The fast path (kernels/fused_moe.py's routing and experts with the dense path's kernels), in Triton's
    interpreter, against the eager model: packed prefills of 22 rows (the grouped GEMM), 5 rows (the decode
    path's tensor-core tile) and one row (its CUDA-core one). (The attention decode kernel, slow in the
    interpreter, has the dense model's tests; the experts' paths go by row count.)"""
    pytest.importorskip("llmserve_core.kernels.fused_moe", reason="kernels/fused_moe.py is not in this tree")
    path = make_random_qwen3_dir(seed=5, moe=True, initializer_range=0.1, **MOE_CONFIGS["e12-top3-raw-mlp-only"])
    cfg = ModelConfig.from_hf_dir(path)
    eager = load_model(cfg, path, "auto", torch.float32, "cpu", BACKEND)
    fused = load_model(cfg, path, "auto", torch.float32, "cpu", get_backend("triton", "cpu"))
    fused.set_fused(True)
    assert all(block.fused for _, block in fused.moe_blocks())
    for lens in ([7, 3, 12], [4, 1], [1]):
        num_blocks, [(ids, batch)] = prefill_then_decodes(cfg, lens, BLOCK_SIZE, decodes=0)
        caches = [make_kv_caches(cfg, num_blocks, BLOCK_SIZE) for _ in range(2)]
        want = eager.compute_logits(eager(ids, batch, caches[0]))
        got = fused.compute_logits(fused(ids, batch, caches[1]))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


# ---- config.json ----------------------------------------------------------------------------------------

def _moe_raw(**extra):
    base = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=100, hidden_size=32,
                intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    return {**base, **extra}


def test_config_reads_both_spellings_of_the_expert_count():
    raw = _moe_raw()
    del raw["num_experts"]
    cfg = ModelConfig.from_dict({**raw, "num_local_experts": 6, "mlp_only_layers": [3, 0], "decoder_sparse_step": 2})
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 6, 2)
    assert cfg.mlp_only_layers == (0, 3) and not cfg.norm_topk_prob
    assert [cfg.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
    assert not ModelConfig.from_dict(dict(_moe_raw(), model_type="qwen3", architectures=["Qwen3ForCausalLM"])
                                     ).is_sparse_layer(0)


@pytest.mark.parametrize("raw, match", [
    (_moe_raw(num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"),
    (_moe_raw(num_experts=0), "num_experts must be a positive integer"),
    (_moe_raw(num_experts=2**64), r"num_experts \(18446744073709551616\) exceeds 65536"),
    (_moe_raw(num_experts_per_tok=-1), "num_experts_per_tok must be a positive integer"),
    (_moe_raw(num_experts_per_tok=1.5), "num_experts_per_tok must be a positive integer"),
    (_moe_raw(moe_intermediate_size=None), "moe_intermediate_size must be a positive integer"),
    (_moe_raw(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer"),
    (_moe_raw(mlp_only_layers=[4]), "mlp_only_layers must list layers in"),
    (_moe_raw(mlp_only_layers=[-2**63]), "mlp_only_layers must list layers in"),
    (_moe_raw(mlp_only_layers="0"), "mlp_only_layers"),
    (_moe_raw(norm_topk_prob="yes"), "norm_topk_prob must be true or false"),
    (_moe_raw(shared_expert_intermediate_size=64), "shared_expert_intermediate_size is not supported"),
    (_moe_raw(architectures=["Qwen3ForCausalLM"]), "Qwen3-MoE"),
    (_moe_raw(model_type=["qwen3_moe"]), r"got model_type=\['qwen3_moe'\]"),
])
def test_config_errors_name_the_field(raw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("shape,total,active", [("30b-a3b", 30.53e9, 3.35e9), ("235b-a22b", 235.09e9, 22.19e9)])
def test_benchmark_shapes_have_the_published_parameter_counts(shape, total, active, tmp_path):
    """benchmarks/qwen3_moe.py's config.json builds the published sizes (on the meta device: no memory)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from qwen3_moe import write_qwen3_moe_dir
    cfg = ModelConfig.from_hf_dir(write_qwen3_moe_dir(str(tmp_path), shape))
    model = Qwen3MoeForCausalLM(cfg, None, torch.bfloat16, "meta", max_positions=4096)
    params = sum(p.numel() for p in model.parameters())
    idle = cfg.num_hidden_layers * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size \
        * cfg.moe_intermediate_size
    assert abs(params - total) < 0.01e9 and abs(params - idle - active) < 0.01e9


class _OneRankOf:
    """A stand-in tensor-parallel group for one of `size` expert-parallel ranks: its shard's experts, and an
    all-reduce that leaves the partial sum for the test to add up."""

    def __init__(self, experts: tuple[int, int]):
        self.shard = type("Shard", (), {"experts": experts})()

    def all_reduce(self, x):
        return x


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True])
def test_expert_parallel_ranks_sum_to_the_whole_layer(fused):
    """Each rank holds a quarter of the experts and masks the router's other picks; the four partial sums
    add up to the layer that holds them all (on the fast path too, whose kernels skip id -1, and which
    routes a CUDA graph's padding rows, past live_rows, to no expert)."""
    if fused:
        pytest.importorskip("llmserve_core.kernels.fused_moe", reason="kernels/fused_moe.py is not in this tree")
    cfg = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, model_type="qwen3_moe", num_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=False)
    torch.manual_seed(0)
    whole = SparseMoeBlock(cfg)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(11, 32)
    live = torch.tensor([8], dtype=torch.int32) if fused else None     # 3 padding rows
    total = torch.zeros(11, 32)
    for rank in range(4):
        part = SparseMoeBlock(cfg, _OneRankOf((2 * rank, 2)))
        assert part.w13.shape == (2, 32, 32) and part.expert_parallel
        part.gate.weight.copy_(whole.gate.weight)
        part.w13.copy_(whole.w13[2 * rank:2 * rank + 2])
        part.w2.copy_(whole.w2[2 * rank:2 * rank + 2])
        part.fused = fused
        total += part(x, live_rows=live)
    whole.fused = fused
    want = whole(x, live_rows=live)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)
    if fused:
        assert (want[8:] == 0).all()
        whole.fused = False
        torch.testing.assert_close(want[:8], whole(x)[:8], atol=1e-5, rtol=1e-5)
