"""Write a small but real Hugging Face Qwen3 (or Qwen3-MoE) directory: what tests, examples and CPU runs load.

The weights come from transformers' own Qwen3ForCausalLM (Qwen3MoeForCausalLM with moe=True) under a fixed
seed and are written by its save_pretrained, so the directory is exactly what transformers produces for
such a checkpoint. The
tokenizer is a byte-level BPE trained on the shipped corpus with Qwen's special tokens and ChatML
chat template. Same seed and overrides -> byte-identical files. From the shell:
`llmserve-core make-tiny-model DIR` (llmserve_core/cli.py).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
TOKENIZER_VOCAB_SIZE = 1024
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TINY_CONFIG = dict(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    initializer_range=0.02,
)
# What moe=True adds: 8 experts of 32 features, 2 routed per token, every layer sparse.
TINY_MOE_CONFIG = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def make_tiny_model(out_dir, seed: int = 0, moe: bool = False, embedding: bool = False, **overrides) -> str:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer into out_dir.

    overrides are Qwen3Config fields (e.g. num_hidden_layers=4, tie_word_embeddings=False,
    rope_scaling={"rope_type": "yarn", "factor": 4.0}), or with moe=True Qwen3MoeConfig fields (num_experts,
    num_experts_per_tok, mlp_only_layers, ...). vocab_size may exceed the tokenizer's 1024 (padded rows, as
    real checkpoints have) but not fall below it. embedding: a Qwen3Model checkpoint as Qwen3-Embedding ships
    (no lm_head, tensors named without `model.`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    config = {**TINY_CONFIG, **(TINY_MOE_CONFIG if moe else {}), **overrides}
    if config["vocab_size"] < tokenizer.get_vocab_size():
        raise ValueError(f"vocab_size: {config['vocab_size']} is smaller than the tokenizer's "
                         f"{tokenizer.get_vocab_size()} tokens")
    write_random_qwen3(out, seed, moe=moe, embedding=embedding, **config)
    write_tokenizer(tokenizer, out)
    return str(out)


def write_random_qwen3(out_dir, seed: int = 0, moe: bool = False, embedding: bool = False, **config) -> str:
    """A Qwen3 (or Qwen3-MoE) checkpoint with transformers' own seeded init (normal, std initializer_range;
    norms at 1), in the layout its save_pretrained writes (for MoE each expert apart); embedding: transformers'
    Qwen3Model (the decoder alone) instead of Qwen3ForCausalLM."""
    import torch
    from transformers import (GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3Model, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    config = dict(config)
    rope = config.pop("rope_scaling", None)
    theta = config.pop("rope_theta", 10000.0)
    config["rope_parameters"] = {"rope_type": "default", **(rope or {}), "rope_theta": theta}
    config.setdefault("bos_token_id", 0)
    config.setdefault("eos_token_id", 2)
    config.setdefault("pad_token_id", 0)
    config_class, model_class = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    hf_config = config_class(**config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (Qwen3Model if embedding and not moe else model_class)(hf_config)
    model.save_pretrained(out_dir, safe_serialization=True)
    # Qwen3's chat models stop on <|im_end|> and on <|endoftext|>.
    eos = hf_config.eos_token_id
    GenerationConfig(bos_token_id=hf_config.bos_token_id, pad_token_id=hf_config.pad_token_id,
                     eos_token_id=[eos, 0] if eos != 0 else [0]).save_pretrained(out_dir)
    return str(out_dir)


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """Byte-level BPE (every byte string encodes, decoding round-trips) trained on the shipped corpus."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


@lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    # Training takes about a second; tests write many model dirs with the same tokenizer.
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from llmserve_core.data import corpus_paragraphs

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_paragraphs(), trainer=trainer)
    return tokenizer.to_str()


def write_tokenizer(tokenizer, out_dir) -> None:
    out = Path(out_dir)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special = {"eos_token": IM_END, "pad_token": ENDOFTEXT, "additional_special_tokens": [IM_START, IM_END]}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
