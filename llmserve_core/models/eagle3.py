"""The EAGLE-3 draft head (config: eagle3_config.py; loading: eagle3_loader.py).

Shape of the head (one decoder layer, as vLLM's llama_eagle3 and speculators' Eagle3DecoderLayer):
    fused  = fc(concat(aux hidden states of 3 target layers))                 [T, 3Ht] -> [T, H]
    e      = input_layernorm(embed(token))
    h, res = hidden_norm(x), hidden_norm(x)   if norm_before_residual         (x: fused, or the draft's
             hidden_norm(x), x                 otherwise                        own pre-norm output)
    h      = attn(concat(e, h)) + res       q/k/v read the 2H concat, o_proj writes H
    h      = mlp(post_attention_layernorm(h)) + h
    logits = lm_head(norm(h)) over the draft vocabulary; target id = draft id + d2t[draft id]
The pre-norm h is what the next draft step consumes in place of `fused`.
"""
from __future__ import annotations

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
from llmserve_core.models.eagle3_config import Eagle3Config

KVCache = tuple[torch.Tensor, torch.Tensor]


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
