"""The Qwen3-MoE shapes (config.json only) that the MoE speed benchmarks load with --load-format dummy:
Qwen3-30B-A3B (also the shape of Qwen3-Coder-30B-A3B-Instruct, whose context is longer) and Qwen3-235B-A22B."""
from __future__ import annotations

import json
import os

QWEN3_30B_A3B_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
    bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16", hidden_act="silu", attention_bias=False,
)
# Qwen3-Coder-30B-A3B-Instruct: the 30B-A3B shape with a 262,144-token context.
QWEN3_CODER_30B_A3B_OVERRIDES = dict(max_position_embeddings=262144, rope_theta=10000000.0)
QWEN3_235B_A22B_CONFIG = dict(
    QWEN3_30B_A3B_CONFIG, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
    num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
)
MOE_SHAPES = {"30b-a3b": QWEN3_30B_A3B_CONFIG, "235b-a22b": QWEN3_235B_A22B_CONFIG}


def write_qwen3_moe_dir(path: str, shape: str = "30b-a3b", **overrides) -> str:
    """config.json of `shape` (a key of MOE_SHAPES; `overrides` on top: a smaller smoke shape, Qwen's FP8
    quantization_config, benchmarks/qwen3_8b.QWEN_FP8_BLOCK_CONFIG) at `path`."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(MOE_SHAPES[shape], **overrides), f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [151645, 151643]}, f)
    return path
