"""Load a Qwen3 checkpoint (single or sharded safetensors) or make dummy weights from config.json alone.

Each checkpoint tensor is read from the memory-mapped file and copied straight into its slot of the
(possibly packed) parameter on the target device, converting dtype in the same copy: peak extra memory
is one tensor, never a float32 copy of the model.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from llmserve_core.models.config import ModelConfig
from llmserve_core.models.qwen3 import Qwen3ForCausalLM

LOAD_FORMATS = ("auto", "safetensors", "dummy")
# Checkpoint tensors that carry no weights of ours (old exports saved the rotary table).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# HF name piece -> (packed parameter piece, index of the shard within it)
PACKED_WEIGHTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def load_model(cfg: ModelConfig, path, load_format: str = "auto", dtype: torch.dtype = torch.float32,
               device="cpu", attn_backend=None, seed: int = 0, max_positions: int | None = None) -> Qwen3ForCausalLM:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    device = torch.device(device)
    model = Qwen3ForCausalLM(cfg, attn_backend, dtype, device, max_positions=max_positions)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors(model, path)
    return model.eval()


def init_dummy_weights(model: Qwen3ForCausalLM, seed: int) -> None:
    """vLLM's convention: small uniform values so activations stay finite at any depth; norms at one."""
    generator = torch.Generator(device=model.lm_head_weight.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-1e-3, 1e-3, generator=generator)


def checkpoint_files(path) -> list[Path]:
    """The safetensors files of a model directory: the shards an index names, or model.safetensors."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model: {str(path)!r} is not a directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"model: {index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"model: shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"model: no model.safetensors or model.safetensors.index.json in {str(path)!r} "
                            f"(use load_format='dummy' for random weights)")


def _checkpoint_names(name: str) -> list[str]:
    """The checkpoint tensor names that make up one of our parameters."""
    for piece, (packed, _) in PACKED_WEIGHTS.items():
        if f".{packed}." in name:
            return [name.replace(f".{packed}.", f".{p}.") for p, (q, _) in PACKED_WEIGHTS.items() if q == packed]
    return [name]


def _target(hf_name: str, cfg: ModelConfig) -> tuple[str, int | None, int]:
    """(our parameter name, row offset into it or None for a whole tensor, rows) for one checkpoint name."""
    for piece, (packed, shard) in PACKED_WEIGHTS.items():
        if f".{piece}." in hf_name:
            name = hf_name.replace(f".{piece}.", f".{packed}.")
            if packed.endswith("qkv_proj"):
                sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
            else:
                sizes = [cfg.intermediate_size, cfg.intermediate_size]
            return name, sum(sizes[:shard]), sizes[shard]
    return hf_name, None, 0


@torch.no_grad()
def load_safetensors(model: Qwen3ForCausalLM, path) -> None:
    cfg = model.cfg
    params = dict(model.named_parameters())
    # Every (parameter, row offset) that must be written; packed parameters need all their shards.
    expected = {_target(hf, cfg)[:2]: hf for name in params for hf in _checkpoint_names(name)}
    done: set[tuple[str, int | None]] = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if _IGNORED.match(hf_name):
                    continue
                if hf_name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: the embedding is the head
                name, offset, rows = _target(hf_name, cfg)
                if name not in params:
                    raise ValueError(f"model: checkpoint tensor {hf_name!r} in {file.name} has no place in Qwen3 "
                                     f"with this config.json")
                param = params[name]
                dest = param if offset is None else param[offset:offset + rows]
                tensor = f.get_tensor(hf_name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"model: checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                     f"config.json implies {tuple(dest.shape)}")
                dest.copy_(tensor)
                done.add((name, offset))
    missing = [hf for key, hf in expected.items() if key not in done]
    if missing:
        raise ValueError(f"model: checkpoint at {str(path)!r} lacks tensors: {', '.join(sorted(missing)[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
