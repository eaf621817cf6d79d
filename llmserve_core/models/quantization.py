"""FP8 weights for Qwen3: which scheme a checkpoint uses, which layers it covers, and loading its tensors.

Three ways in, one layer (layers.fp8_linear.Fp8Linear):
- Qwen's FP8 releases, config.json `quantization_config` {quant_method: "fp8", fmt: "e4m3",
  weight_block_size: [128, 128], activation_scheme: "dynamic"}: float8_e4m3fn weights, float32
  `weight_scale_inv` per 128 x 128 tile (or one per tensor without weight_block_size).
- compressed-tensors FP8 (quant_method "compressed-tensors", format "float-quantized"): float8_e4m3fn weights
  with `weight_scale` per output channel ([N] or [N, 1]), per tensor, or per block; activations are
  quantized per token at run time. A static `input_scale` is read past: dynamic per-token scales are at least
  as accurate and need no calibration. The `ignore` list names modules that stay in bf16.
- `--quantization fp8` on a bf16/fp16 checkpoint (or dummy weights): each weight is quantized as it is
  loaded, with one scale per output channel.
Embeddings, norms and lm_head always stay in the model dtype, and so does a MoE layer's router. Scales travel
with the q/k/v and gate/up packing: per-channel scales stack like rows, block scales by whole tiles (so every
packed shard must be a whole number of tiles). A MoE layer's experts (layers/moe.py) are covered all or none,
and stack their scales per expert the same way.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from llmserve_core.kernels.fp8_format import FP8
from llmserve_core.layers.fp8_linear import Fp8Linear
from llmserve_core.layers.moe import SparseMoeBlock
from llmserve_core.models.config import ModelConfig

QUANTIZATION_METHODS = ("fp8",)
# Our linear layers that FP8 may cover, and the checkpoint modules packed into each.
QUANTIZABLE = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
# The checkpoint modules of each expert of a MoE layer (layers/moe.py packs gate and up as w13, down is w2).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Per-tensor KV cache scales (compressed-tensors' kv_cache_scheme, vLLM's exports): k_scale / v_scale on the
# attention module, or the older output_scale on k_proj / v_proj.
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
_ACTIVATION_SCALE = re.compile(r".*\.input_scale$")


@dataclass(frozen=True)
class Fp8Scheme:
    method: str                          # "fp8" (Qwen), "compressed-tensors", or "online"
    block: tuple[int, int] | None        # weight scale tile (bn, bk); None: one scale per output row
    scale_name: str | None               # checkpoint suffix of the weight scale; None when quantized at load
    ignore: tuple[str, ...] = ()         # module names (or "re:" patterns) the checkpoint left unquantized

    @property
    def prequantized(self) -> bool:
        return self.scale_name is not None

    def ignores(self, module: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                # re.match, as compressed-tensors and vLLM read these: anchored at the start only.
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.startswith(entry + ".") or module.endswith("." + entry):
                return True
        return False


def resolve_quantization(quant_config: dict | None, requested: str | None) -> Fp8Scheme | None:
    """The FP8 scheme for a checkpoint's `quantization_config` and the `--quantization` flag, or None for bf16."""
    if requested not in (None, *QUANTIZATION_METHODS):
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)} or unset, got {requested!r}")
    if quant_config is None:
        return Fp8Scheme("online", None, None) if requested == "fp8" else None
    if not isinstance(quant_config, dict):
        raise ValueError(f"model: config.json quantization_config must be an object, got {quant_config!r}")
    method = quant_config.get("quant_method")
    if method == "fp8":
        return _qwen_fp8_scheme(quant_config)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(quant_config)
    raise ValueError(f"model: config.json quantization_config.quant_method {method!r} is not supported "
                     f"(supported: 'fp8', 'compressed-tensors' FP8)")


def _qwen_fp8_scheme(qc: dict) -> Fp8Scheme:
    where = "model: config.json quantization_config"
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt: only 'e4m3' is supported, got {fmt!r}")
    activation = qc.get("activation_scheme", "dynamic")
    if activation != "dynamic":
        raise ValueError(f"{where}.activation_scheme: only 'dynamic' is supported, got {activation!r}")
    block = qc.get("weight_block_size")
    if block is not None:
        block = _block_size(block, f"{where}.weight_block_size")
    ignore = [*(qc.get("modules_to_not_convert") or []), *(qc.get("ignored_layers") or [])]
    return Fp8Scheme("fp8", block, "weight_scale_inv", _names(ignore, f"{where}.modules_to_not_convert"))


def _compressed_tensors_scheme(qc: dict) -> Fp8Scheme:
    where = "model: config.json quantization_config"
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"{where}.format: only FP8 'float-quantized' checkpoints are supported, got {fmt!r}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups: must be a non-empty object")
    blocks = set()
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise ValueError(f"{at}: must be an object")
        targets = group.get("targets") or []
        if "Linear" not in targets:
            raise ValueError(f"{at}.targets: only the target 'Linear' is supported, got {targets!r}")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise ValueError(f"{at}.weights: missing")
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(f"{at}.weights: only 8-bit float weights are supported, got num_bits="
                             f"{weights.get('num_bits')!r} type={weights.get('type')!r}")
        if weights.get("symmetric", True) is not True:
            raise ValueError(f"{at}.weights.symmetric: asymmetric FP8 weights are not supported")
        strategy = weights.get("strategy")
        if strategy in ("channel", "tensor"):
            blocks.add(None)
        elif strategy == "block":
            blocks.add(_block_size(weights.get("block_structure"), f"{at}.weights.block_structure"))
        else:
            raise ValueError(f"{at}.weights.strategy: unknown scheme {strategy!r} (supported: channel, tensor, block)")
        acts = group.get("input_activations")
        if acts is not None:
            if acts.get("num_bits") != 8 or acts.get("type") != "float":
                raise ValueError(f"{at}.input_activations: only 8-bit float activations are supported")
            if acts.get("dynamic") is True and acts.get("strategy") not in ("token", "group", None):
                raise ValueError(f"{at}.input_activations.strategy: unknown dynamic scheme {acts.get('strategy')!r}")
    if len(blocks) != 1:
        raise ValueError(f"{where}.config_groups: all groups must share one weight scale layout, "
                         f"got {sorted(map(str, blocks))}")
    ignore = _names(qc.get("ignore") or [], f"{where}.ignore")
    return Fp8Scheme("compressed-tensors", blocks.pop(), "weight_scale", ignore)


# A K tile of the FP8 kernels never straddles a scale block, and the GPU's FP8 products take K in steps of 32:
# narrower blocks run only in the CPU's interpreter.
CUDA_MIN_BLOCK_COLS = 32


def check_fp8_device(scheme: Fp8Scheme | None, device: torch.device) -> None:
    """Refuse, by name, an FP8 scheme that the device's kernels cannot run."""
    if scheme is not None and scheme.block is not None and device.type == "cuda" \
            and scheme.block[1] < CUDA_MIN_BLOCK_COLS:
        raise ValueError(f"quantization_config: {list(scheme.block)} scale blocks are {scheme.block[1]} columns "
                         f"wide; on CUDA they must be at least {CUDA_MIN_BLOCK_COLS} (the GPU's FP8 products take "
                         f"K in steps of {CUDA_MIN_BLOCK_COLS}, and a K tile never straddles a scale block)")


def _block_size(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 16 for v in value)):
        raise ValueError(f"{where}: must be two positive integers [rows, cols] up to 65536, got {value!r}")
    if any(v & (v - 1) for v in value) or value[1] < 16:
        raise ValueError(f"{where}: block sides must be powers of two and cols >= 16, got {value!r}")
    return int(value[0]), int(value[1])


def _names(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: must be a list of module names, got {value!r}")
    return tuple(value)


# ---- building the model --------------------------------------------------------------------------

def apply_fp8(model: nn.Module, cfg: ModelConfig, scheme: Fp8Scheme) -> None:
    """Swap every covered linear of the (still meta) Qwen3 model for an Fp8Linear of the same shape, and
    hold every covered MoE layer's experts in FP8."""
    for i, layer in enumerate(model.model.layers):
        sparse = isinstance(layer.mlp, SparseMoeBlock)
        if sparse:
            _apply_fp8_experts(i, layer.mlp, scheme)
        for ours, pieces in QUANTIZABLE.items():
            if sparse and ours.startswith("mlp."):
                continue
            names = [f"model.layers.{i}.{p}" for p in pieces]
            skipped = [scheme.ignores(n) for n in names]
            if any(skipped) and not all(skipped):
                raise ValueError(f"model: quantization_config ignore list leaves {names[skipped.index(True)]} "
                                 f"in bf16 but quantizes {names[skipped.index(False)]}; they are packed into one "
                                 f"{ours} and must share a format")
            if all(skipped):
                continue
            parent_name, attr = ours.split(".")
            parent = getattr(layer, parent_name)
            old = getattr(parent, attr)
            if scheme.block is not None:
                _check_block_packing(cfg, ours, names, scheme.block)
            new = Fp8Linear(old.in_features, old.out_features, scheme.block).to(old.weight.device)
            setattr(parent, attr, new)


def _apply_fp8_experts(layer: int, block: SparseMoeBlock, scheme: Fp8Scheme) -> None:
    names = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for e in range(block.num_experts) for p in EXPERT_PROJECTIONS]
    skipped = [scheme.ignores(n) for n in names]
    if all(skipped):
        return
    if any(skipped):
        raise ValueError(f"model: quantization_config ignore list leaves {names[skipped.index(True)]} in bf16 but "
                         f"quantizes {names[skipped.index(False)]}; a layer's experts are stacked into one tensor "
                         f"and must share a format")
    if scheme.block is not None:
        # gate and up pack by whole row blocks; a rank's slice of every expert (tensor parallelism) must also
        # be whole column blocks of down_proj.
        bn, bk = scheme.block
        split = block.tp is not None and not block.expert_parallel
        if block.intermediate_size % bn or (split and block.intermediate_size % bk):
            raise ValueError(f"model: the experts' moe_intermediate_size ({block.intermediate_size} on this rank) is "
                             f"not whole {bn} x {bk} scale blocks, so their block scales cannot be packed"
                             + (" or split over the ranks (--enable-expert-parallel keeps every expert whole)"
                                if split else ""))
    block.make_fp8(scheme.block)


def _check_block_packing(cfg: ModelConfig, ours: str, names: list[str], block: tuple[int, int]) -> None:
    rows = {"self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
            "mlp.gate_up_proj": [cfg.intermediate_size] * 2}.get(ours)
    if rows is None:
        return
    for name, n in zip(names[:-1], rows[:-1]):
        if n % block[0]:
            raise ValueError(f"model: {name} has {n} rows, not a multiple of the {block[0]}-row scale blocks, "
                             f"so its block scales cannot be packed into {ours}")


# ---- loading -------------------------------------------------------------------------------------

def checkpoint_param_name(name: str, module: nn.Module, scheme: Fp8Scheme | None) -> str | None:
    """The checkpoint name of one of our parameters (before q/k/v packing is undone), or None when the
    checkpoint does not hold it (scales made by quantizing at load)."""
    if isinstance(module, Fp8Linear) and name.endswith(".weight_scale"):
        if scheme is None or not scheme.prequantized:
            return None
        return name[:-len("weight_scale")] + scheme.scale_name
    return name


def kv_scale_target(hf_name: str) -> tuple[int, str] | None:
    """(layer, 'k' | 'v') for a checkpoint's per-tensor KV cache scale, else None."""
    m = _KV_SCALE.fullmatch(hf_name)
    return (int(m.group(1)), m.group(2) or m.group(3)) if m else None


def load_kv_scale(model: nn.Module, hf_name: str, tensor: torch.Tensor, target: tuple[int, str]) -> None:
    layer, which = target
    if layer >= len(model.model.layers):
        raise ValueError(f"model: checkpoint tensor {hf_name!r} names layer {layer}, the model has "
                         f"{len(model.model.layers)}")
    if tensor.numel() != 1:
        raise ValueError(f"model: checkpoint tensor {hf_name!r} must hold one per-tensor scale, has shape "
                         f"{tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not math.isfinite(value) or not 1e-30 < value < 1e30:
        raise ValueError(f"model: checkpoint tensor {hf_name!r} is {value}, a KV scale must be finite and positive, "
                         f"within (1e-30, 1e30)")
    setattr(model.model.layers[layer].self_attn, f"{which}_scale", value)


def skips_tensor(hf_name: str, scheme: Fp8Scheme | None) -> bool:
    """Checkpoint tensors we read past: static activation scales (activations are quantized dynamically)."""
    return scheme is not None and scheme.prequantized and bool(_ACTIVATION_SCALE.match(hf_name))


def load_fp8_tensor(module: Fp8Linear, suffix: str, hf_name: str, tensor: torch.Tensor, offset: int | None,
                    rows: int, scheme: Fp8Scheme | None) -> None:
    """Write one checkpoint tensor (a weight or its scale, possibly one shard of a packed layer) into module."""
    offset = offset or 0
    rows = rows or module.out_features
    if suffix == "weight":
        want = (rows, module.in_features)
        if tuple(tensor.shape) != want:
            raise ValueError(f"model: checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"config.json implies {want}")
        if scheme is not None and scheme.prequantized:
            if tensor.dtype != FP8:
                raise ValueError(f"model: checkpoint tensor {hf_name!r} is {tensor.dtype}, quantization_config "
                                 f"says float8_e4m3fn (list the module in its ignore list to keep it unquantized)")
            module.weight[offset:offset + rows].copy_(tensor)
        else:
            if not tensor.is_floating_point() or tensor.dtype == FP8:
                raise ValueError(f"model: checkpoint tensor {hf_name!r} is {tensor.dtype}; --quantization fp8 "
                                 f"quantizes float16/bfloat16/float32 weights (FP8 checkpoints say so in config.json)")
            module.quantize_rows_(tensor, offset)
        return
    if scheme is None or not scheme.prequantized or suffix != scheme.scale_name:
        reads = f"'weight' and '{scheme.scale_name}'" if scheme is not None and scheme.prequantized else "'weight' only"
        raise ValueError(f"model: checkpoint tensor {hf_name!r} has no place in this model: "
                         f"its FP8 layer reads {reads}")
    if not tensor.is_floating_point() or tensor.dtype == FP8:
        raise ValueError(f"model: checkpoint tensor {hf_name!r} is {tensor.dtype}, scales must be float32/bf16/fp16")
    scale = tensor.float()
    if not torch.isfinite(scale).all() or (scale <= 0).any():
        raise ValueError(f"model: checkpoint tensor {hf_name!r} holds a scale that is not finite and positive")
    if module.block is None:
        if scale.numel() == 1:                   # one scale per tensor: the same for every row
            scale = scale.reshape(1).expand(rows)
        elif tuple(scale.shape) in ((rows,), (rows, 1)):
            scale = scale.reshape(rows)
        else:
            raise ValueError(f"model: checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, a per-channel "
                             f"scale of this weight must be [{rows}] or [{rows}, 1] (or one per-tensor value)")
        module.weight_scale[offset:offset + rows].copy_(scale)
        return
    bn, bk = module.block
    want = (-(-rows // bn), -(-module.in_features // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"model: checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, {bn} x {bk} "
                         f"block scales of this weight must be {list(want)}")
    module.weight_scale[offset // bn:offset // bn + want[0]].copy_(scale)
