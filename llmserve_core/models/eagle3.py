"""The EAGLE-3 draft head, read from the public `speculators` format (what RedHatAI's Qwen3 speculators
ship), plus a writer for matching tiny drafts.

Shape of the head (one decoder layer, as vLLM's llama_eagle3 and speculators' Eagle3DecoderLayer):
    fused  = fc(concat(aux hidden states of 3 target layers))                 [T, 3Ht] -> [T, H]
    e      = input_layernorm(embed(token))
    h, res = hidden_norm(x), hidden_norm(x)   if norm_before_residual         (x: fused, or the draft's
             hidden_norm(x), x                 otherwise                        own pre-norm output)
    h      = attn(concat(e, h)) + res       q/k/v read the 2H concat, o_proj writes H
    h      = mlp(post_attention_layernorm(h)) + h
    logits = lm_head(norm(h)) over the draft vocabulary; target id = draft id + d2t[draft id]
The pre-norm h is what the next draft step consumes in place of `fused`.

Config (config.json): `speculators_model_type: eagle3`, `transformer_layer_config` (a Llama-style layer
config: hidden_size, heads, head_dim, intermediate_size, rms_norm_eps, rope, vocab_size of the target),
`draft_vocab_size`, `norm_before_residual` (absent means true, as vLLM reads speculators configs),
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (optional). A flat config without
`transformer_layer_config` (the older EAGLE-3 release format) is read as the layer config itself, where
vLLM's default for norm_before_residual is false.

Tensors: fc.weight [H, 3Ht] (fc.bias optional), layers.0.* (older files: midlayer.*), norm.weight,
lm_head.weight [draft_vocab, H], d2t [draft_vocab], t2d [vocab]; embed_tokens.weight and lm_head.weight
may be absent, and then the target's are shared.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmserve_core.layers import index_checks
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.layers.activation import silu_and_mul
from llmserve_core.layers.fast_path import fast_path
from llmserve_core.layers.linear import MAX_ROWS as GEMV_MAX_ROWS
from llmserve_core.layers.norm import RMSNorm
from llmserve_core.layers.rotary import RotaryEmbedding
from llmserve_core.models.config import _read_rope, read_json
from llmserve_core.models.loader import PACKED_WEIGHTS, checkpoint_files, open_checkpoint

KVCache = tuple[torch.Tensor, torch.Tensor]


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


class Eagle3Attention(nn.Module):
    fused = False   # set by the draft model on the fast path: q/k norm, rotary and the K/V store in one kernel

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(2 * cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qkv(self, x: torch.Tensor, cos, sin):
        """x [..., 2H] -> q [..., heads, d], k, v [..., kv_heads, d], rotary applied (eager)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin), v

    def q_storing_kv(self, x: torch.Tensor, cos, sin, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Fused (packed rows [T, 2H]; cos/sin the whole tables): q [T, heads, d], with k and v already
        written into the cache at batch.slot_mapping, by one kernel."""
        from llmserve_core.kernels.qk_norm_rope import qk_norm_rope_store
        norm = self.q_norm is not None
        return qk_norm_rope_store(self.qkv_proj(x), batch.positions, batch.slot_mapping,
                                  self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                                  cos, sin, self.q_norm.eps if norm else 0.0, self.num_heads, self.num_kv_heads,
                                  self.head_dim, kv_cache[0], kv_cache[1])


class Eagle3MLP(nn.Module):
    fused = False   # set by the draft model on the fast path: SiLU-and-mul as one Triton kernel

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        if self.fused:
            from llmserve_core.kernels.silu_mul import silu_mul
            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = Eagle3MLP(cfg)

    def attn_input(self, embeds, hidden):
        """(concat(normed embeds, normed hidden) [.., 2H], residual [.., H])."""
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(embeds), hidden], dim=-1), residual

    def finish(self, attn_out, residual):
        """Everything after attention: (output stream before the final norm's add, residual)."""
        h, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(h), residual


class Eagle3DraftModel(nn.Module):
    """Same calling convention as the target: packed tokens, a ForwardBatch, its own paged KV (one layer)."""

    def __init__(self, cfg: Eagle3Config, attn_backend, dtype: torch.dtype, device, max_positions: int | None = None,
                 has_embed: bool = True, has_lm_head: bool = True, fc_bias: bool = False):
        super().__init__()
        self.cfg = cfg
        self.attn_backend = attn_backend
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if has_embed else None
            self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=fc_bias)
            self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg)])
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False) if has_lm_head else None
        self.to(dtype).to_empty(device=device)
        self.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=device))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool, device=device)
                             if cfg.draft_vocab_size == cfg.vocab_size else
                             torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device))
        self.rotary = RotaryEmbedding(cfg.head_dim, max(max_positions or 0, cfg.max_position_embeddings),
                                      cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, dtype, device)
        self._shared_embed: torch.Tensor | None = None
        self._shared_lm_head: torch.Tensor | None = None
        # The target's switch: on the fast path norms, rotary, SiLU-and-mul and the head run as Triton
        # kernels; the dense training/test forward keeps the eager modules.
        self.set_fused(fast_path(device, attn_backend))

    def set_fused(self, fused: bool) -> None:
        """Switch every module between its Triton kernels and its eager torch ops (as the target does)."""
        self.fused = fused
        for m in self.modules():
            if isinstance(m, (RMSNorm, Eagle3Attention, Eagle3MLP)):
                m.fused = fused

    # -- weights shared with the target ------------------------------------------------------------
    def share_target_weights(self, embed_weight: torch.Tensor | None, lm_head_weight: torch.Tensor | None) -> None:
        """Use the target's embedding / head where the draft checkpoint has none of its own."""
        if self.embed_tokens is None:
            if embed_weight is None or tuple(embed_weight.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
                raise ValueError("speculative_model: the draft has no embed_tokens and the target's embedding "
                                 f"does not fit [{self.cfg.vocab_size}, {self.cfg.hidden_size}]")
            self._shared_embed = embed_weight
        if self.lm_head is None:
            if self.cfg.draft_vocab_size != self.cfg.vocab_size:
                raise ValueError("speculative_model: lm_head.weight is missing and draft_vocab_size differs from "
                                 "the target vocabulary, so the target's head cannot stand in")
            if lm_head_weight is None or tuple(lm_head_weight.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
                raise ValueError("speculative_model: the draft has no lm_head and the target's head does not fit")
            self._shared_lm_head = lm_head_weight

    @property
    def embed_weight(self) -> torch.Tensor:
        w = self.embed_tokens.weight if self.embed_tokens is not None else self._shared_embed
        if w is None:
            raise RuntimeError("speculative_model: embed_tokens is shared from the target; call share_target_weights")
        return w

    @property
    def lm_head_weight(self) -> torch.Tensor:
        w = self.lm_head.weight if self.lm_head is not None else self._shared_lm_head
        if w is None:
            raise RuntimeError("speculative_model: lm_head is shared from the target; call share_target_weights")
        return w

    # -- forward -----------------------------------------------------------------------------------
    def combine_aux(self, aux_hidden: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """The target's 3 aux hidden states [T, Ht] each (or already concatenated) -> fused [T, H]."""
        if isinstance(aux_hidden, (list, tuple)):
            aux_hidden = torch.cat(list(aux_hidden), dim=-1)
        return self.fc(aux_hidden)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache):
        """input_ids [T], hidden [T, H] (fused aux or the previous step's pre-norm output) ->
        (normed [T, H] for logits, pre-norm [T, H] to feed the next draft step)."""
        if index_checks.ENABLED:
            index_checks.check_forward("the draft's forward", batch, input_ids, kv_cache[0], self.embed_weight.shape[0],
                                       self.rotary.cos.shape[0])
        layer = self.layers[0]
        x, residual = layer.attn_input(F.embedding(input_ids, self.embed_weight), hidden)
        attn = layer.self_attn
        if self.fused:
            q = attn.q_storing_kv(x, self.rotary.cos, self.rotary.sin, batch, kv_cache)
            out = self.attn_backend.attend(q, kv_cache[0], kv_cache[1], batch, attn.scale)
        else:
            q, k, v = attn.qkv(x, *self.rotary.cos_sin(batch.positions))
            out = self.attn_backend.forward(q, k, v, kv_cache[0], kv_cache[1], batch, attn.scale)
        h, residual = layer.finish(layer.self_attn.o_proj(out.flatten(-2)), residual)
        return self.norm(h, residual)

    def forward_dense(self, input_ids: torch.Tensor, hidden: torch.Tensor, step: int = 0,
                      earlier: list[KVCache] | None = None):
        """Torch reference without a paged cache, batched [B, S] (training and tests).

        step 0: row r is position r; plain causal attention. step s > 0 (training-time test): row r is
        position r + s and continues the draft chain begun at row r of step 0; it sees step 0's keys at
        positions <= r and, of steps 1..s, only the keys of its own chain, exactly what a draft step
        sees at inference. `earlier` holds the (k, v) of steps 0..s-1; returns (normed, pre-norm, (k, v)).
        """
        if self.fused:
            raise RuntimeError("forward_dense: the eager reference; load the draft with the torch attention backend")
        earlier = earlier or []
        if len(earlier) != step:
            raise ValueError(f"forward_dense: step {step} needs the keys of {step} earlier steps, got {len(earlier)}")
        layer = self.layers[0]
        attn = layer.self_attn
        seq = input_ids.shape[1]
        x, residual = layer.attn_input(F.embedding(input_ids, self.embed_weight), hidden)
        positions = torch.arange(step, step + seq, device=input_ids.device)
        cos, sin = self.rotary.cos_sin(positions)
        q, k, v = attn.qkv(x, cos, sin)                                        # [B, S, h, d]
        group = attn.num_heads // attn.num_kv_heads
        keys = [kv[0] for kv in earlier] + [k]
        values = [kv[1] for kv in earlier] + [v]
        qf = q.float()
        k0 = keys[0].float().repeat_interleave(group, dim=2)
        scores0 = torch.einsum("bqhd,bkhd->bhqk", qf, k0) * attn.scale
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        scores0 = scores0.masked_fill(~causal, float("-inf"))
        diag = [torch.einsum("bqhd,bqhd->bhq", qf, kj.float().repeat_interleave(group, dim=2)) * attn.scale
                for kj in keys[1:]]
        scores = torch.cat([scores0] + [d[..., None] for d in diag], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :seq], values[0].float().repeat_interleave(group, dim=2))
        for j, vj in enumerate(values[1:]):
            out = out + probs[..., seq + j].transpose(1, 2)[..., None] * vj.float().repeat_interleave(group, dim=2)
        h, residual = layer.finish(attn.o_proj(out.to(q.dtype).flatten(-2)), residual)
        normed, prenorm = self.norm(h, residual)
        return normed, prenorm, (k, v)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [N, H] -> float32 logits over the draft vocabulary [N, draft_vocab]."""
        if self.fused and 0 < normed.shape[0] <= GEMV_MAX_ROWS:
            from llmserve_core.kernels.gemv import gemv
            return gemv(normed, self.lm_head_weight, out_dtype=torch.float32)
        return F.linear(normed, self.lm_head_weight).float()


# -- loading --------------------------------------------------------------------------------------

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


# -- writing tiny drafts --------------------------------------------------------------------------

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

