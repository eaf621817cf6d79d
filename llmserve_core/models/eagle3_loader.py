"""Loading an EAGLE-3 draft head from a speculators-format directory (or dummy weights from its config).

Tensors: fc.weight [H, 3Ht] (fc.bias optional), layers.0.* (older files: midlayer.*), norm.weight,
lm_head.weight [draft_vocab, H], d2t [draft_vocab], t2d [vocab]; embed_tokens.weight and lm_head.weight
may be absent, and then the target's are shared.
"""
from __future__ import annotations

import torch

from llmserve_core.models.eagle3 import Eagle3DraftModel
from llmserve_core.models.eagle3_config import Eagle3Config
from llmserve_core.models.loader import PACKED_WEIGHTS, checkpoint_files, open_checkpoint


def _normalize_name(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return name


def _read_checkpoint(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in checkpoint_files(path):
        with open_checkpoint(file, "speculative_model") as f:
            for name in f.keys():
                tensors[_normalize_name(name)] = f.get_tensor(name)
    return tensors


def _packed_slices(cfg: Eagle3Config) -> dict[str, tuple[str, int, int]]:
    sizes = {"self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
             "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size]}
    out = {}
    for piece, (packed, shard) in PACKED_WEIGHTS.items():
        s = sizes[packed]
        out[f"layers.0.{piece}.weight"] = (f"layers.0.{packed}.weight", sum(s[:shard]), s[shard])
    return out


def load_eagle3(path, attn_backend=None, dtype: torch.dtype = torch.float32, device="cpu",
                target_embed: torch.Tensor | None = None, target_lm_head: torch.Tensor | None = None,
                load_format: str = "auto", seed: int = 0, max_positions: int | None = None) -> Eagle3DraftModel:
    """Build the draft from a speculators-format directory. Missing embed_tokens / lm_head are taken
    from the target (pass its embedding and head weights). load_format 'dummy' makes random weights
    from config.json alone, with its own embedding and head."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format: must be auto, safetensors or dummy, got {load_format!r}")
    cfg = Eagle3Config.from_dir(path)
    device = torch.device(device)
    if load_format == "dummy":
        model = Eagle3DraftModel(cfg, attn_backend, dtype, device, max_positions)
        init_dummy_weights(model, seed)
        return model.eval()
    tensors = _read_checkpoint(path)
    model = Eagle3DraftModel(cfg, attn_backend, dtype, device, max_positions,
                             has_embed="embed_tokens.weight" in tensors, has_lm_head="lm_head.weight" in tensors,
                             fc_bias="fc.bias" in tensors)
    if cfg.qk_norm is False and "layers.0.self_attn.q_norm.weight" in tensors:
        raise ValueError("speculative_model: checkpoint has q_norm/k_norm but transformer_layer_config.model_type "
                         "is not qwen3")
    _copy_tensors(model, tensors, path)
    model.share_target_weights(target_embed, target_lm_head)
    return model.eval()


@torch.no_grad()
def _copy_tensors(model: Eagle3DraftModel, tensors: dict[str, torch.Tensor], path) -> None:
    cfg = model.cfg
    params = dict(model.named_parameters())
    packed = _packed_slices(cfg)
    done = set()
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "d2t":
            if tuple(tensor.shape) != (cfg.draft_vocab_size,):
                raise ValueError(f"speculative_model: d2t has shape {tuple(tensor.shape)}, expected ({cfg.draft_vocab_size},)")
            target_ids = torch.arange(cfg.draft_vocab_size) + tensor.long()
            if bool((target_ids < 0).any()) or bool((target_ids >= cfg.vocab_size).any()):
                raise ValueError("speculative_model: d2t maps draft ids outside the target vocabulary")
            model.d2t.copy_(tensor.long())
            done.add(name)
            continue
        if name == "t2d":
            if tuple(tensor.shape) != (cfg.vocab_size,):
                raise ValueError(f"speculative_model: t2d has shape {tuple(tensor.shape)}, expected ({cfg.vocab_size},)")
            model.t2d.copy_(tensor.bool())
            done.add(name)
            continue
        if name in packed:
            dest_name, offset, rows = packed[name]
            dest = params[dest_name][offset:offset + rows]
            done.add((dest_name, offset))
        elif name in params:
            dest = params[name]
            done.add(name)
        else:
            raise ValueError(f"speculative_model: checkpoint tensor {name!r} has no place in an EAGLE-3 head")
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"speculative_model: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"config.json implies {tuple(dest.shape)}")
        dest.copy_(tensor)
    expected = set()
    for name in params:
        pieces = [(n, off) for n, (d, off, _) in packed.items() if d == name]
        expected |= {(name, off) for _, off in pieces} if pieces else {name}
    missing = sorted(str(e if isinstance(e, str) else f"{e[0]}[{e[1]}:]") for e in expected - done)
    if missing:
        raise ValueError(f"speculative_model: checkpoint at {str(path)!r} lacks tensors: {', '.join(missing)}")
    if "d2t" not in done and cfg.draft_vocab_size != cfg.vocab_size:
        raise ValueError("speculative_model: draft_vocab_size differs from the target vocabulary but d2t is missing")
    if "t2d" not in done and cfg.draft_vocab_size != cfg.vocab_size:
        model.t2d.zero_()
        model.t2d[torch.arange(cfg.draft_vocab_size, device=model.d2t.device) + model.d2t] = True


@torch.no_grad()
def init_dummy_weights(model: Eagle3DraftModel, seed: int, std: float = 0.02) -> None:
    generator = torch.Generator(device=model.fc.weight.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
