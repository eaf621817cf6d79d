"""Load a Qwen3 or Qwen3-MoE checkpoint (single or sharded safetensors) or make dummy weights from config.json
alone. The model class follows config.json's model_type (MODELS); a MoE checkpoint's expert tensors stream
into their stacked weights through models/moe_loading.py.

Each checkpoint tensor is read from the memory-mapped file and copied straight into its slot of the
(possibly packed) parameter on the target device, converting dtype in the same copy: peak extra memory
is one tensor, never a float32 copy of the model. FP8 layers (models/quantization.py decides which) take
their weights and scales through quantization.load_fp8_tensor, which also quantizes float weights on the way
in for --quantization fp8.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from llmserve_core.layers.fp8_linear import Fp8Linear
from llmserve_core.layers.moe import SparseMoeBlock
from llmserve_core.models.config import ModelConfig, read_json
from llmserve_core.models.moe_loading import ExpertLoader
from llmserve_core.models.quantization import Fp8Scheme, check_fp8_device, checkpoint_param_name, kv_scale_target, \
    load_fp8_tensor, load_kv_scale, resolve_quantization, skips_tensor
from llmserve_core.models.qwen3 import Qwen3ForCausalLM
from llmserve_core.models.qwen3_moe import Qwen3MoeForCausalLM

LOAD_FORMATS = ("auto", "safetensors", "dummy")
# config.json's model_type -> the model class that serves it (models/config.py's ARCHITECTURES lists the names).
MODELS = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}
# Checkpoint tensors that carry no weights of ours (old exports saved the rotary table).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# How a Git LFS pointer file begins: what a clone without git-lfs leaves in place of the weights.
_LFS_POINTER = b"version https://git-lfs"
# HF name piece -> (packed parameter piece, index of the shard within it)
PACKED_WEIGHTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def load_model(cfg: ModelConfig, path, load_format: str = "auto", dtype: torch.dtype = torch.float32,
               device="cpu", attn_backend=None, seed: int = 0, max_positions: int | None = None,
               quantization: str | None = None, tp=None) -> Qwen3ForCausalLM:
    """quantization: None serves what the checkpoint holds (FP8 when its config.json says so); 'fp8'
    also quantizes a bf16/fp16 checkpoint's linear layers at load. tp (a distributed.group.TPGroup):
    build and load only this rank's shard (cfg is the full model's)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    device = torch.device(device)
    fp8 = resolve_quantization(cfg.quantization_config, quantization)
    check_fp8_device(fp8, device)
    local_cfg = cfg if tp is None else tp.shard.local_config(cfg)
    model = MODELS[cfg.model_type](local_cfg, attn_backend, dtype, device, max_positions=max_positions, fp8=fp8,
                                   tp=tp)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors(model, path, fp8, full_cfg=cfg if tp is not None else None)
    return model.eval()


def init_dummy_weights(model: Qwen3ForCausalLM, seed: int) -> None:
    """vLLM's convention: small uniform values so activations stay finite at any depth; norms at one."""
    generator = torch.Generator(device=model.lm_head_weight.device).manual_seed(seed)
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    fp8_experts = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.fp8]
    fp8_params = {id(p) for m in fp8_layers for p in m.parameters()}
    fp8_params |= {id(getattr(m, n)) for m in fp8_experts for n in ("w13", "w13_scale", "w2", "w2_scale")}
    for layer in fp8_layers:     # dummy values in the model dtype, quantized as a real checkpoint would be
        w = torch.empty(layer.out_features, layer.in_features, device=layer.weight.device)
        layer.quantize_rows_(w.uniform_(-1e-3, 1e-3, generator=generator))
        del w
    for block in fp8_experts:    # one expert at a time: never a float copy of a layer's experts
        for name in ("w13", "w2"):
            experts, rows, cols = getattr(block, name).shape
            w = torch.empty(rows, cols, device=block.w13.device)
            for e in range(experts):
                block.quantize_expert_(name, e, w.uniform_(-1e-3, 1e-3, generator=generator))
            del w
    for name, param in model.named_parameters():
        if id(param) in fp8_params:
            continue
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
        weight_map = read_json(index).get("weight_map")
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


def open_checkpoint(file: Path, who: str = "model"):
    """safe_open one checkpoint file; one that is not safetensors raises a ValueError naming it (the CLI's
    config error, not a crash): what a clone without git-lfs leaves, or an interrupted download."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as e:
        with open(file, "rb") as f:
            pointer = f.read(len(_LFS_POINTER)) == _LFS_POINTER
        hint = (" but a Git LFS pointer: fetch the weights (git lfs pull)" if pointer else
                f" ({e}; an interrupted download?)")
        raise ValueError(f"{who}: {file} is not a readable safetensors file{hint}") from None


def _causal_lm_name(stored: str, cfg: ModelConfig) -> str:
    """A checkpoint tensor's name as Qwen3ForCausalLM spells it: a Qwen3Model checkpoint (Qwen3-Embedding)
    names the decoder's tensors without the `model.` prefix."""
    if cfg.pooling_only and not stored.startswith(("model.", "lm_head.")):
        return "model." + stored
    return stored


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
def load_safetensors(model: Qwen3ForCausalLM, path, fp8: Fp8Scheme | None = None,
                     full_cfg: ModelConfig | None = None) -> None:
    """full_cfg: the whole model's config when `model` is one tensor-parallel shard of it."""
    cfg = model.cfg
    shard = model.tp.shard if model.tp is not None else None
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    owner = {name: modules[name.rpartition(".")[0]] for name in params}
    experts = ExpertLoader({i: m for i, layer in enumerate(model.model.layers)
                            if isinstance(m := layer.mlp, SparseMoeBlock)}, fp8, shard, full_cfg)
    # Every checkpoint tensor that must be present; packed parameters need all their shards (the experts
    # keep their own account: they come in either of two layouts).
    expected = {hf for name in params if not isinstance(owner[name], SparseMoeBlock)
                and (ck := checkpoint_param_name(name, owner[name], fp8)) is not None
                for hf in _checkpoint_names(ck)}
    done: set[str] = set()
    for file in checkpoint_files(path):
        with open_checkpoint(file) as f:
            for stored in f.keys():
                hf_name = _causal_lm_name(stored, cfg)
                if _IGNORED.match(hf_name) or skips_tensor(hf_name, fp8):
                    continue
                if experts.owns(hf_name):
                    experts.load(hf_name, f)
                    continue
                if hf_name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: the embedding is the head
                if (kv := kv_scale_target(hf_name)) is not None:
                    load_kv_scale(model, hf_name, f.get_tensor(stored), kv)
                    continue
                name, offset, rows = _target(hf_name, cfg)
                module_name, _, suffix = name.rpartition(".")
                module = modules.get(module_name)
                if isinstance(module, Fp8Linear):
                    if shard is None:
                        tensor = f.get_tensor(stored)
                    elif suffix == "weight":
                        tensor = shard.slice_checkpoint(hf_name, f.get_slice(stored), full_cfg)
                    else:
                        tensor = shard.slice_weight_scale(hf_name, f.get_tensor(stored), full_cfg, module.block)
                    load_fp8_tensor(module, suffix, hf_name, tensor, offset, rows, fp8)
                    done.add(hf_name)
                    continue
                if name not in params:
                    raise ValueError(f"model: checkpoint tensor {hf_name!r} in {file.name} has no place in the model "
                                     f"with this config.json")
                param = params[name]
                dest = param if offset is None else param[offset:offset + rows]
                tensor = (f.get_tensor(stored) if shard is None else
                          shard.slice_checkpoint(hf_name, f.get_slice(stored), full_cfg))
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"model: checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                     f"config.json implies {tuple(dest.shape)}")
                if tensor.dtype == torch.float8_e4m3fn:
                    raise ValueError(f"model: checkpoint tensor {hf_name!r} is float8_e4m3fn, but config.json's "
                                     f"quantization_config does not cover it")
                dest.copy_(tensor)
                done.add(hf_name)
    missing = sorted(expected - done) + experts.missing()
    if missing:
        raise ValueError(f"model: checkpoint at {str(path)!r} lacks tensors: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
