"""Qwen3-MoE on CUDA: the fast path (kernels/fused_moe.py under the Triton attention backend) against the
torch reference path and transformers, float32 token-exact and bf16 in agreement, graphs equal to eager, FP8
experts (per channel and 128 x 128 blocks) against the reference, EAGLE-3 over a MoE target, and the
Qwen3-30B-A3B shape from config.json alone. Needs a GPU; skipped without one.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers.models import hf_greedy_generate as hf_greedy
from helpers.models import varied_prompts as prompts
from llmserve_core import Engine, EngineConfig
from llmserve_proto import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# 16 experts of 256, top-4, layer 2 dense: wide enough for the kernels' real tiles, small enough to write.
MID = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, num_experts=16, num_experts_per_tok=4,
           moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[2])
ENGINE = dict(device="cuda", num_kv_blocks=256, max_model_len=1024, max_num_seqs=16)


@pytest.fixture(scope="module")
def mid_model(make_random_qwen3_dir):
    return make_random_qwen3_dir(seed=11, moe=True, initializer_range=0.05, **MID)


def hf_model(path, dtype):
    from transformers import Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def generate(path, n_new, **kw):
    engine = Engine(EngineConfig(model=path, **{**ENGINE, **kw}))
    ps = prompts(engine.model_info.vocab_size)
    got = engine.generate(ps, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
    return engine, ps, [c.token_ids for c in got]


@pytest.mark.parametrize("backend,eager", [("torch", True), ("triton", True), ("triton", False)])
def test_float32_cuda_token_exact(mid_model, backend, eager):
    engine, ps, got = generate(mid_model, 12, dtype="float32", attention_backend=backend, enforce_eager=eager)
    assert (engine.runner.graphs is None) == eager
    hf = hf_model(mid_model, torch.float32)
    exact = sum(g == hf_greedy(hf, p, 12) for g, p in zip(got, ps))
    print(f"MoE float32 {backend} eager={eager}: {exact}/{len(ps)} prompts token-exact")
    assert exact == len(ps)


def test_bf16_fast_path_agrees_with_transformers(mid_model):
    """Teacher-forced: transformers' argmax on our tokens, so one near-tie does not derail a row."""
    n_new = 16
    _, ps, got = generate(mid_model, n_new, dtype="bfloat16", attention_backend="triton")
    hf = hf_model(mid_model, torch.bfloat16)
    agree = total = 0
    for p, toks in zip(ps, got):
        with torch.no_grad():
            logits = hf(torch.tensor([p + toks], device="cuda")).logits[0]
        ref = logits[len(p) - 1:len(p) - 1 + n_new].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(ref, toks))
        total += n_new
    print(f"MoE bf16 fast path vs transformers: top-1 agreement {agree}/{total}")
    assert agree / total >= 0.9


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graphs_equal_eager(mid_model, dtype):
    outs = [generate(mid_model, 24, dtype=dtype, attention_backend="triton", enforce_eager=eager)[2]
            for eager in (True, False)]
    same = sum(a == b for a, b in zip(*outs))
    print(f"MoE {dtype} graphs vs eager: {same}/{len(outs[0])} identical")
    assert same >= len(outs[0]) - (1 if dtype == "bfloat16" else 0)


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 5, 64, 300, 2048])
@pytest.mark.parametrize("fp8", [None, "channel", "block"])
def test_moe_layer_fast_path_matches_its_reference(rows, fp8):
    """One SparseMoeBlock at Qwen3-30B-A3B's widths (128 experts of 768 over 2048, top-8), bf16 or FP8,
    fused against the torch reference on the same weights and the same routing."""
    from llmserve_core.layers.moe import SparseMoeBlock
    from llmserve_core.models.config import ModelConfig
    cfg = ModelConfig(vocab_size=8, hidden_size=2048, intermediate_size=6144, num_hidden_layers=1,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, model_type="qwen3_moe",
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
    g = torch.Generator(device="cuda").manual_seed(rows)
    with torch.device("meta"):
        block = SparseMoeBlock(cfg).to(torch.bfloat16)
    if fp8:
        block.make_fp8(None if fp8 == "channel" else (128, 128))
    block.to_empty(device="cuda")
    block.gate.weight.normal_(0, 0.05, generator=g)
    for name in ("w13", "w2"):
        w = getattr(block, name)
        for e in range(w.shape[0]):
            value = torch.empty(w.shape[1:], device="cuda").normal_(0, 0.02, generator=g)
            if fp8:
                block.quantize_expert_(name, e, value)
            else:
                w[e].copy_(value)
    x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
    block.fused = False
    want = block(x)
    block.fused = True
    got = block(x)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    print(f"MoE layer rows={rows} fp8={fp8}: relative error {err:.2e}")
    assert err < (0.08 if fp8 else 1.5e-2)      # the kernels' own bounds: W8A8 rounds the rows to e4m3


def _fp8_block_checkpoint(src, out: Path) -> str:
    """src's experts and projections in Qwen's 128 x 128 block FP8 format (the MID widths are whole blocks)."""
    from helpers.fp8 import qwen_fp8_config, write_fp8_checkpoint
    return write_fp8_checkpoint(src, out, qwen_fp8_config((128, 128)))[0]


@pytest.mark.parametrize("fmt", ["online-channel", "block-128"])
def test_fp8_fast_path_agrees_with_the_reference(mid_model, tmp_path, fmt):
    path = mid_model if fmt == "online-channel" else _fp8_block_checkpoint(mid_model, tmp_path / "fp8")
    quantization = "fp8" if fmt == "online-channel" else None
    outs = [generate(path, 16, dtype="bfloat16", attention_backend=b, quantization=quantization)[2]
            for b in ("torch", "triton")]
    agree = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(*outs))
    total = sum(len(x) for x in outs[0])
    print(f"MoE FP8 {fmt}: fast path vs reference {agree}/{total} tokens equal")
    assert agree / total >= 0.9


def test_eagle3_over_a_moe_target_on_cuda(mid_model, tmp_path):
    """float32, graphs on: drafting never changes the target's greedy tokens."""
    from llmserve_core.models.tiny_draft import make_tiny_draft
    draft = make_tiny_draft(tmp_path / "draft", mid_model, seed=1)
    _, _, plain = generate(mid_model, 16, dtype="float32", attention_backend="triton")
    engine, _, spec = generate(mid_model, 16, dtype="float32", attention_backend="triton", speculative_model=draft,
                               speculative_gamma=3, speculative_policy="always")
    assert spec == plain
    assert engine.stats()["spec_num_drafted_steps"] > 0


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_30b_a3b_shape_loads_and_steps(tmp_path, quantization):
    """The MoE benchmarks' model: Qwen3-30B-A3B's config.json alone, dummy weights, bf16 or FP8."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from qwen3_moe import write_qwen3_moe_dir
    path = write_qwen3_moe_dir(str(tmp_path / "30b"))
    engine = Engine(EngineConfig(model=path, load_format="dummy", quantization=quantization, max_model_len=4096,
                                 max_num_seqs=64))
    got = engine.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(c.token_ids) == 8 for c in got)
    print(f"30B-A3B dummy {quantization or 'bf16'}: {engine.stats()['total_kv_blocks']} KV blocks")
    del engine
    shutil.rmtree(tmp_path / "30b")
    torch.cuda.empty_cache()
