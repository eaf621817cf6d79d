"""Qwen3-MoE over several ranks on the CPU (gloo): each expert's intermediate columns split over the ranks
(tensor parallelism, as the dense MLP) or whole experts per rank (--enable-expert-parallel), greedy outputs
token-identical to one rank in float32 with chunked prefill, preemption and prefix hits, both expert
layouts, FP8 experts, the decode graphs' bookkeeping and EAGLE-3; and the errors for shapes that do not
split."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.distributed import graph_path, run  # noqa: F401  (graph_path: a fixture)
from helpers.fp8 import compressed_tensors_config, qwen_fp8_config, write_fp8_checkpoint
from llmserve_core.distributed.sharding import ShardSpec
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.tiny_draft import make_tiny_draft

# 8 experts of 32 columns, top-2, layer 1 dense; 4 query heads over 2 KV heads.
SHAPE = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1],
             vocab_size=1030, tie_word_embeddings=False, initializer_range=0.3)


@pytest.fixture(scope="module")
def moe_dir(make_random_qwen3_dir):
    return make_random_qwen3_dir(seed=3, moe=True, **SHAPE)


@pytest.fixture(scope="module")
def one_rank(moe_dir):
    want, stats = run(moe_dir, 1)
    assert stats["num_preemptions"] > 0 and stats["prefix_hits"] > 0
    return want


def test_shard_spec_splits_experts_or_their_columns():
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, model_type="qwen3_moe", num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,))
    tp = [ShardSpec.of(cfg, r, 4) for r in range(4)]
    assert [s.experts for s in tp] == [(0, 8)] * 4
    assert [s.moe_intermediate for s in tp] == [(r * 8, 8) for r in range(4)]
    assert tp[1].local_config(cfg).moe_intermediate_size == 8 and tp[1].local_config(cfg).num_experts == 8
    ep = [ShardSpec.of(cfg, r, 4, expert_parallel=True) for r in range(4)]
    assert [s.experts for s in ep] == [(r * 2, 2) for r in range(4)] and ep[3].moe_intermediate == (0, 32)
    assert ep[3].local_config(cfg).moe_intermediate_size == 32
    w = torch.arange(32.0 * 64).view(32, 64)                                  # an expert's gate_proj [I, H]
    gate, down = "model.layers.0.mlp.experts.5.gate_proj.weight", "model.layers.0.mlp.experts.5.down_proj.weight"
    assert torch.equal(tp[2].slice_checkpoint(gate, w, cfg), w[16:24])
    assert torch.equal(tp[2].slice_checkpoint(down, w.t(), cfg), w.t()[:, 16:24])
    assert torch.equal(ep[2].slice_checkpoint(gate, w, cfg), w)
    assert torch.equal(ep[2].slice_checkpoint(down, w.t(), cfg), w.t())
    # Block scales follow whole blocks: 8 columns per rank split 16-wide blocks.
    blocks = torch.ones(2, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks split .*experts.5.gate_proj.*16-wide"):
        tp[1].slice_weight_scale(gate.replace("weight", "weight_scale_inv"), blocks, cfg, (16, 16))
    assert ep[1].slice_weight_scale(gate.replace("weight", "weight_scale_inv"), blocks, cfg, (16, 16)) is blocks


SMALL = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=12,
                    num_key_value_heads=12, head_dim=16, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=32, mlp_only_layers=(1,))


@pytest.mark.parametrize("size,ep,shape,match", [
    (3, True, {}, "3 does not divide the model's 8 experts"),
    (4, False, {"moe_intermediate_size": 30}, "4 does not divide the model's experts' intermediate size 30"),
    (4, True, {"intermediate_size": 30}, "4 does not divide the model's intermediate size 30"),
])
def test_shapes_that_do_not_split_are_named(size, ep, shape, match):
    with pytest.raises(ValueError, match=f"tensor_parallel_size: {match}"):
        ShardSpec.of(dataclasses.replace(SMALL, **shape), 0, size, expert_parallel=ep)


def test_a_model_without_dense_layers_never_splits_their_size():
    ShardSpec.of(dataclasses.replace(SMALL, mlp_only_layers=(), intermediate_size=30), 0, 4)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, False), (2, True), (4, True)], ids=["tp2", "ep2", "ep4"])
def test_greedy_equals_one_rank(moe_dir, one_rank, tp, ep):
    got, stats = run(moe_dir, tp, enable_expert_parallel=ep)
    assert got == one_rank
    assert stats["prefix_hits"] > 0


@pytest.mark.slow
def test_stacked_layout_under_tp2_equals_one_rank(moe_dir, one_rank, tmp_path):
    """transformers' stacked experts, each rank reading only its columns of every expert."""
    from transformers import Qwen3MoeForCausalLM
    import shutil
    out = tmp_path / "stacked"
    Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).save_pretrained(out, save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(f"{moe_dir}/{name}", out / name)
    got, _ = run(str(out), 2)
    assert got == one_rank


@pytest.mark.slow
@pytest.mark.parametrize("fmt,ep", [("qwen-block16x32", True), ("compressed-tensors-channel", False)])
def test_fp8_experts_split_equal_one_rank(moe_dir, tmp_path, fmt, ep):
    """Block-scaled experts whole per rank (16 columns a rank would split the 32-wide scale blocks); per-
    channel experts split by columns."""
    qc = qwen_fp8_config((16, 32)) if "block" in fmt else compressed_tensors_config(("lm_head", "re:.*mlp.gate$"))
    ckpt, _ = write_fp8_checkpoint(moe_dir, tmp_path / "fp8", qc)
    want, _ = run(ckpt, 1)
    got, _ = run(ckpt, 2, enable_expert_parallel=ep)
    assert got == want
    if ep:
        with pytest.raises(ValueError, match=r"\(16 on this rank\) is not whole 16 x 32 scale blocks.*expert-parallel"):
            run(ckpt, 2)


@pytest.mark.slow
def test_ep2_decode_graphs_and_eagle3_equal_one_rank(moe_dir, one_rank, graph_path, tmp_path):
    """Expert parallelism with the graph path on and EAGLE-3 drafting every step: the workers replay the
    verify graph and mask their experts in it as rank 0 does."""
    draft = make_tiny_draft(tmp_path / "draft", moe_dir, seed=1)
    got, stats = run(moe_dir, 2, enable_expert_parallel=True, speculative_model=draft, speculative_gamma=2,
                     speculative_policy="always", num_kv_blocks=40)
    assert got == one_rank
    assert stats["spec_num_drafted_steps"] > 0
    assert "verify" in {name for name, _, _ in graph_path}
