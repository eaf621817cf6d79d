"""Tiny EAGLE-3 drafts for tests and experiments: random heads in the speculators format that fit a Qwen3
model written by tiny.py (`llmserve-core make-tiny-model --draft`), and the writer the training script
uses for trained ones."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from llmserve_core.models.eagle3 import Eagle3DraftModel
from llmserve_core.models.eagle3_config import Eagle3Config
from llmserve_core.models.eagle3_loader import init_dummy_weights


def speculators_config(target_config: dict, *, draft_vocab_size: int, intermediate_size: int | None = None,
                       aux_layer_ids=None, norm_before_residual: bool = True, speculative_tokens: int = 3,
                       verifier: str = "tiny-qwen3") -> dict:
    """A speculators-format config.json for a head over a Qwen3 target with the given HF config."""
    hidden = target_config["hidden_size"]
    rope = dict(target_config.get("rope_parameters") or {})
    theta = rope.get("rope_theta", target_config.get("rope_theta", 10000.0))
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": intermediate_size or target_config["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": target_config["num_attention_heads"],
        "num_key_value_heads": target_config.get("num_key_value_heads", target_config["num_attention_heads"]),
        "head_dim": target_config.get("head_dim") or hidden // target_config["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": None,
        "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": target_config["vocab_size"],
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": ["Qwen3ForCausalLM"]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab_size,
        "norm_before_residual": norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids) if aux_layer_ids is not None else None,
        "torch_dtype": "float32",
    }


def vocab_mapping(draft_token_ids: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a draft vocabulary made of the given target ids (sorted ascending, as speculators
    builds it from token frequencies)."""
    ids = torch.tensor(sorted(set(draft_token_ids)), dtype=torch.long)
    if ids.numel() != len(draft_token_ids) or bool((ids < 0).any()) or bool((ids >= vocab_size).any()):
        raise ValueError("draft_token_ids: must be distinct ids inside the target vocabulary")
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def write_eagle3_dir(out_dir, config: dict, tensors: dict[str, torch.Tensor], legacy_names: bool = False) -> str:
    """Write config.json and model.safetensors (names in the speculators layout; `midlayer.*` if legacy)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    named = {}
    for name, t in tensors.items():
        if legacy_names and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        named[name] = t.detach().contiguous().cpu()
    save_file(named, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def checkpoint_tensors(model: Eagle3DraftModel, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names (q/k/v and gate/up unpacked), plus d2t and t2d."""
    cfg = model.cfg
    out = {}
    for name, param in model.named_parameters():
        t = param.detach()
        if dtype is not None:
            t = t.to(dtype)
        if name.endswith("qkv_proj.weight"):
            q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            base = name[:-len("qkv_proj.weight")]
            out.update({base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v})
        elif name.endswith("gate_up_proj.weight"):
            g, u = t.chunk(2)
            base = name[:-len("gate_up_proj.weight")]
            out.update({base + "gate_proj.weight": g, base + "up_proj.weight": u})
        else:
            out[name] = t
    out["d2t"] = model.d2t.detach().cpu()
    out["t2d"] = model.t2d.detach().cpu()
    return out


def make_tiny_draft(out_dir, target_dir, seed: int = 0, draft_vocab_size: int | None = None,
                    include_embed: bool = False, include_lm_head: bool = True, legacy_names: bool = False,
                    aux_layer_ids=None) -> str:
    """Write a random EAGLE-3 head in the speculators format that fits the Qwen3 model in target_dir.

    By default the draft vocabulary is half the target's (every other target id, so d2t is a real
    mapping), and embed_tokens is left out so the target's embedding is shared, as in RedHatAI's
    Qwen3 speculators."""
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    vocab = target_config["vocab_size"]
    draft_vocab_size = draft_vocab_size or max(1, vocab // 2)
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size: must be in [1, {vocab}], got {draft_vocab_size}")
    stride = vocab // draft_vocab_size
    draft_ids = [i * stride for i in range(draft_vocab_size)]
    if not include_lm_head and draft_vocab_size != vocab:
        raise ValueError("include_lm_head: a draft without its own head needs draft_vocab_size == vocab_size")
    config = speculators_config(target_config, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids)
    cfg = Eagle3Config.from_dict(config)
    model = Eagle3DraftModel(cfg, None, torch.float32, "cpu")
    init_dummy_weights(model, seed)
    model.d2t.copy_(vocab_mapping(draft_ids, vocab)[0])
    model.t2d.copy_(vocab_mapping(draft_ids, vocab)[1])
    tensors = checkpoint_tensors(model)
    if not include_embed:
        tensors.pop("embed_tokens.weight")
    if not include_lm_head:
        tensors.pop("lm_head.weight")
    return write_eagle3_dir(out_dir, config, tensors, legacy_names=legacy_names)
