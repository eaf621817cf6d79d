"""FP8 checkpoints for tests: Qwen's block-scaled and per-tensor formats and compressed-tensors', written by
quantizing a float checkpoint (with a float twin holding exactly the dequantized weights)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers.batch import make_batch, make_kv_caches
from llmserve_core.kernels.fp8_format import FP8, dequantize_weight, quantize_per_block, quantize_per_channel

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def qwen_fp8_config(block):
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def compressed_tensors_config(ignore=("lm_head",), strategy="channel"):
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(ignore),
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


def write_fp8_checkpoint(src, out, quant_config, keep_bf16=()) -> tuple[str, str]:
    """Quantize src's linear weights into out as quant_config describes; also write out-twin, a float32
    checkpoint of exactly the dequantized weights. Modules named in keep_bf16 stay unquantized."""
    src, out = Path(src), Path(out)
    twin = out.with_name(out.name + "-twin")
    for d in (out, twin):
        shutil.copytree(src, d)
        (d / "model.safetensors").unlink()
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    quantized, dequantized = {}, {}
    block = tuple(quant_config["weight_block_size"]) if quant_config.get("weight_block_size") else None
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS and module not in keep_bf16:
            if block is not None:
                q, s = quantize_per_block(t, block)
                quantized[module + ".weight_scale_inv"] = s
            elif quant_config["quant_method"] == "fp8":            # Qwen's format without blocks: one per tensor
                s = (t.float().abs().max() / 448).reshape(())
                q = (t.float() / s).clamp(-448, 448).to(FP8)
                quantized[module + ".weight_scale_inv"] = s
                s = s.expand(t.shape[0])
            else:
                q, s = quantize_per_channel(t)
                quantized[module + ".weight_scale"] = s[:, None]     # compressed-tensors stores [N, 1]
            quantized[name] = q
            dequantized[name] = dequantize_weight(q, s, block)
        else:
            quantized[name] = dequantized[name] = t.float()
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(twin / "model.safetensors"), metadata={"format": "pt"})
    for d, qc in ((out, quant_config), (twin, None)):
        cfg = json.loads((d / "config.json").read_text())
        if qc is not None:
            cfg["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out), str(twin)


def logits_of(model, prompts):
    """Last-position logits of each prompt, one prefill each."""
    rows = []
    for p in prompts:
        kv = make_kv_caches(model.cfg, num_blocks=8, block_size=16)
        batch = make_batch([(0, len(p))], [list(range(1, 1 + -(-len(p) // 16)))], 16)
        rows.append(model.compute_logits(model(torch.tensor(p), batch, kv)[-1:]))
    return torch.cat(rows)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def broken_copy(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)
