"""ModelConfig: the shape of a Qwen3 or Qwen3-MoE checkpoint, read from a Hugging Face model directory.

Accepts both config.json dialects transformers has written: the 4.x one (top-level `rope_theta`,
`rope_scaling`, `torch_dtype`, `num_experts`) and the 5.x one (`rope_parameters` holding both, `dtype`,
`num_local_experts`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
MAX_EXPERTS = 1 << 16
# model_type -> the architectures config.json may name for it (models/loader.py picks the class by model_type).
ARCHITECTURES = {"qwen3": ("Qwen3ForCausalLM", "Qwen3Model"),
                 "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeModel")}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE, else the scaling dict with a normalized "rope_type" key.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    quantization_config: dict | None = None   # config.json's, as written (models/quantization.py reads it)
    path: str | None = None
    model_type: str = "qwen3"
    # Qwen3-MoE (model_type qwen3_moe): a sparse layer's MLP routes each token to num_experts_per_tok of
    # num_experts SiLU-gated experts of moe_intermediate_size; the other layers keep a dense MLP of
    # intermediate_size. num_experts 0: every layer dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    architectures: list[str] = field(default_factory=list)

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the routed experts, as transformers' Qwen3MoeDecoderLayer decides."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def pooling_only(self) -> bool:
        """A base-model checkpoint (Qwen3Model: Qwen3-Embedding): the decoder without an lm_head, so nothing to
        sample or score with; its tensors are named without the `model.` prefix."""
        return bool(self.architectures) and not any(a.endswith("ForCausalLM") for a in self.architectures)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model serves. YaRN with an explicit factor extends the pretraining
        length factor-fold: Qwen3's long-context recipe adds factor 4 over original_max_position_embeddings
        32768 to a config.json that keeps max_position_embeddings 40960, and serves 131072 (as vLLM and
        SGLang derive it). YaRN's frequencies do not depend on the position, so the rotary cache just
        extends."""
        s = self.rope_scaling
        if s is not None and s["rope_type"] == "yarn" and s.get("factor") is not None:
            return max(self.max_position_embeddings, int(s["original_max_position_embeddings"] * s["factor"]))
        return self.max_position_embeddings

    @classmethod
    def from_hf_dir(cls, path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model: {str(path)!r} is not a directory")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model: no config.json in {str(path)!r}")
        raw = read_json(config_file)
        gen_file = path / "generation_config.json"
        generation = read_json(gen_file) if gen_file.is_file() else {}
        cfg = cls.from_dict(raw, generation)
        cfg.path = str(path)
        return cfg

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        architectures = raw.get("architectures") or []
        known = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
        if known is None or (architectures and not set(architectures) & set(known)):
            supported = "; ".join(f"model_type {t!r} with architectures {list(a)}" for t, a in ARCHITECTURES.items())
            raise ValueError(f"model: only Qwen3 and Qwen3-MoE checkpoints are supported ({supported}), "
                             f"got model_type={model_type!r}, architectures={architectures!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(raw.get(name), int) or raw[name] <= 0:
                raise ValueError(f"model: config.json field {name} must be a positive integer, got {raw.get(name)!r}")
        if raw.get("attention_bias"):
            raise ValueError("model: config.json field attention_bias=true is not supported (Qwen3 has no qkv bias)")
        # transformers' Qwen3 applies whatever hidden_act names; the MLP here (and its fused kernel) is SiLU.
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model: config.json field hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("use_sliding_window"):
            raise ValueError("model: config.json field use_sliding_window=true is not supported")

        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"model: num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        # transformers' Qwen3Config defaults head_dim to 128 (not hidden/heads); follow it so a config
        # without the field means the same model here as there.
        head_dim = raw.get("head_dim") or 128
        if head_dim % 2:
            raise ValueError(f"model: head_dim must be even for rotary embeddings, got {head_dim}")

        rope_theta, rope_scaling = _read_rope(raw)
        eos = _eos_ids(generation.get("eos_token_id") if generation else None)
        if not eos:
            eos = _eos_ids(raw.get("eos_token_id"))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
            quantization_config=raw.get("quantization_config"),
            model_type=model_type,
            **(_moe_fields(raw) if model_type == "qwen3_moe" else {}),
            architectures=[a for a in architectures if isinstance(a, str)],
        )


def _moe_fields(raw: dict) -> dict:
    """The Qwen3-MoE fields of config.json, each checked by name. transformers 5 writes num_experts as
    num_local_experts; Qwen's releases write num_experts."""
    def positive(name: str, value) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"model: config.json field {name} must be a positive integer, got {value!r}")
        return value
    experts_key = "num_experts" if "num_experts" in raw else "num_local_experts"
    if raw.get("num_local_experts", raw.get("num_experts")) != raw.get("num_experts", raw.get("num_local_experts")):
        raise ValueError(f"model: config.json fields num_experts ({raw['num_experts']!r}) and num_local_experts "
                         f"({raw['num_local_experts']!r}) disagree")
    experts = positive(experts_key, raw.get(experts_key))
    if experts > MAX_EXPERTS:     # routing ids are int32 and the router one row per expert: refuse nonsense early
        raise ValueError(f"model: config.json field {experts_key} ({experts}) exceeds {MAX_EXPERTS}")
    top_k = positive("num_experts_per_tok", raw.get("num_experts_per_tok"))
    if top_k > experts:
        raise ValueError(f"model: config.json field num_experts_per_tok ({top_k}) exceeds {experts_key} ({experts})")
    layers = raw["num_hidden_layers"]
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                             for i in only):
        raise ValueError(f"model: config.json field mlp_only_layers must list layers in [0, {layers}), got {only!r}")
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"model: config.json field norm_topk_prob must be true or false, got {norm!r}")
    for name in ("shared_expert_intermediate_size", "n_shared_experts"):
        if raw.get(name):
            raise ValueError(f"model: config.json field {name} is not supported (Qwen3-MoE has no shared experts)")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=positive("moe_intermediate_size", raw.get("moe_intermediate_size")),
                norm_topk_prob=norm,
                decoder_sparse_step=positive("decoder_sparse_step", raw.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(sorted(set(only))))


def read_json(file: Path, who: str = "model"):
    """A JSON file of a model directory; malformed, a ValueError naming it."""
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{who}: {file} is not valid JSON: {e}") from None


def _eos_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"model: eos_token_id must be an int or a list of ints, got {value!r}")


def _read_rope(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None), whichever dialect config.json uses."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
    else:
        params = dict(params)
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError("model: per-layer-type rope_parameters are not supported")
    rope_theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if "partial_rotary_factor" in params or "partial_rotary_factor" in raw:
        if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("model: partial_rotary_factor other than 1.0 is not supported")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"model: rope_scaling type {rope_type!r} is not supported, "
                         f"choose from {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return rope_theta, None
    need = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor")}[rope_type]
    for key in need:
        if params.get(key) is None:
            raise ValueError(f"model: rope_scaling type {rope_type!r} needs field {key!r}")
    if rope_type in ("yarn", "llama3"):
        # As transformers: the pretraining length defaults to max_position_embeddings.
        params.setdefault("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 32768)))
    params["rope_type"] = rope_type
    return rope_theta, params
