"""The Qwen3-8B shape (config.json only) that every speed benchmark loads with --load-format dummy."""
from __future__ import annotations

import json
import os

QWEN3_8B_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
    bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16", hidden_act="silu", attention_bias=False,
)


# config.json's quantization_config of Qwen's FP8 releases (e4m3 weights, a float32 scale per 128 x 128 block)
QWEN_FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]}


def write_qwen3_8b_dir(path: str, **overrides) -> str:
    """The 8B config.json (with `overrides` on top: a smaller smoke shape, a quantization_config) at `path`."""
    config = dict(QWEN3_8B_CONFIG, **overrides)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [config["eos_token_id"], config["bos_token_id"]]}, f)
    return path


def smoke_shape() -> dict:
    """The tiny test model's widths (llmserve_core/models/tiny.py) as overrides of the 8B config: what the
    benchmarks' smoke runs load, with dummy weights, on the CPU."""
    from llmserve_core.models.tiny import TINY_CONFIG
    return dict(TINY_CONFIG, bos_token_id=0, eos_token_id=2)

