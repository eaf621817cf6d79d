"""The EAGLE-3 draft head's configuration, read from the public `speculators` format (what RedHatAI's
Qwen3 speculators ship) or the older flat EAGLE-3 config.

Config (config.json): `speculators_model_type: eagle3`, `transformer_layer_config` (a Llama-style layer
config: hidden_size, heads, head_dim, intermediate_size, rms_norm_eps, rope, vocab_size of the target),
`draft_vocab_size`, `norm_before_residual` (absent means true, as vLLM reads speculators configs),
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (optional). A flat config without
`transformer_layer_config` (the older EAGLE-3 release format) is read as the layer config itself, where
vLLM's default for norm_before_residual is false.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmserve_core.models.config import _read_rope, read_json


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's and speculators' default (2, L // 2, L - 3), clamped into range for very shallow targets."""
    top = num_target_layers - 1
    return tuple(min(max(i, 0), top) for i in (2, num_target_layers // 2, num_target_layers - 3))


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                      # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    aux_layer_ids: tuple[int, ...] | None = None     # None: default_aux_layer_ids(target layers)
    qk_norm: bool = False                # Qwen3-style per-head q/k norm (layer config model_type qwen3)
    speculative_tokens: int | None = None

    @classmethod
    def from_dir(cls, path) -> "Eagle3Config":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"speculative_model: no config.json in {str(path)!r}")
        return cls.from_dict(read_json(config_file, "speculative_model"))

    @classmethod
    def from_dict(cls, raw: dict) -> "Eagle3Config":
        speculators = "transformer_layer_config" in raw
        if speculators:
            kind = raw.get("speculators_model_type", "eagle3")
            if kind != "eagle3":
                raise ValueError(f"speculative_model: speculators_model_type {kind!r} is not supported (eagle3 only)")
            layer = raw["transformer_layer_config"]
            if not isinstance(layer, dict):
                raise ValueError("speculative_model: transformer_layer_config must be an object")
        else:
            layer = raw
        for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if not isinstance(layer.get(name), int) or layer[name] <= 0:
                raise ValueError(f"speculative_model: field {name} must be a positive integer, got {layer.get(name)!r}")
        if layer.get("hidden_act", "silu") != "silu":
            raise ValueError(f"speculative_model: hidden_act {layer['hidden_act']!r} is not supported (silu only)")
        if layer.get("attention_bias") or layer.get("mlp_bias"):
            raise ValueError("speculative_model: attention_bias / mlp_bias are not supported")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ValueError("speculative_model: only one-layer EAGLE-3 heads are supported "
                             f"(num_hidden_layers {layer.get('num_hidden_layers')})")
        heads = layer["num_attention_heads"]
        kv_heads = layer.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"speculative_model: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        rope_theta, rope_scaling = _read_rope(layer)
        eagle = raw.get("eagle_config") or {}
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and (len(aux) != 3 or not all(isinstance(i, int) and i >= 0 for i in aux)):
            raise ValueError(f"speculative_model: eagle_aux_hidden_state_layer_ids must be 3 layer indices, got {aux!r}")
        methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
        draft_vocab = raw.get("draft_vocab_size", layer.get("draft_vocab_size")) or layer["vocab_size"]
        if draft_vocab > layer["vocab_size"]:
            raise ValueError(f"speculative_model: draft_vocab_size {draft_vocab} exceeds vocab_size {layer['vocab_size']}")
        nbr = raw.get("norm_before_residual", layer.get("norm_before_residual"))
        return cls(
            hidden_size=layer["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
            intermediate_size=layer["intermediate_size"],
            vocab_size=layer["vocab_size"],
            draft_vocab_size=int(draft_vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or layer.get("target_hidden_size") or layer["hidden_size"]),
            # vLLM: speculators configs default to true, flat EAGLE-3 configs to false.
            norm_before_residual=bool(nbr) if nbr is not None else speculators,
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
            aux_layer_ids=tuple(aux) if aux is not None else None,
            qk_norm=layer.get("model_type") == "qwen3",
            speculative_tokens=methods[0].get("speculative_tokens"),
        )

    def resolve_aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        ids = self.aux_layer_ids or default_aux_layer_ids(num_target_layers)
        if any(i >= num_target_layers for i in ids):
            raise ValueError(f"speculative_model: eagle_aux_hidden_state_layer_ids {list(ids)} out of range for a "
                             f"{num_target_layers}-layer target")
        return tuple(ids)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim
