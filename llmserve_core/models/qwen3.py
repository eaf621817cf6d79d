"""Qwen3 decoder over packed tokens with a paged KV cache.

Parameter names follow the Hugging Face checkpoint, except that q/k/v_proj are packed into one
qkv_proj and gate/up_proj into one gate_up_proj (one matmul each); loader.py does the packing.
The constructor allocates weights without initializing them: load them with models.loader.load_model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve_core.layers import index_checks
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.layers.activation import silu_and_mul
from llmserve_core.layers.fast_path import fast_path, use_pdl
from llmserve_core.kernels.fp8_format import RowQuant
from llmserve_core.layers.fp8_linear import Fp8Linear, QuantizedRows
from llmserve_core.layers.linear import MAX_ROWS, Linear
from llmserve_core.layers.parallel import VocabParallelEmbedding
from llmserve_core.layers.norm import RMSNorm
from llmserve_core.layers.rotary import RotaryEmbedding
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.quantization import Fp8Scheme, apply_fp8

KVCache = tuple[torch.Tensor, torch.Tensor]


class Qwen3Attention(nn.Module):
    fused = False   # set by Qwen3ForCausalLM on CUDA: q/k norm, rotary and the K/V store in one Triton kernel
    pdl = False     # ... launched under PDL on Hopper
    # Per-tensor scales of an FP8 KV cache (real = stored * scale); the loader sets them from the checkpoint.
    k_scale = 1.0
    v_scale = 1.0

    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        # Under tensor parallelism cfg holds this rank's heads: o_proj's product is a partial sum over the
        # ranks, all-reduced here (not in the linear, so any linear, FP8 included, can take its place).
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.tp = tp
        # Qwen3 normalizes each head of q and k before rotary.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache: KVCache, batch: ForwardBatch, attn_backend) -> torch.Tensor:
        """cos/sin: per-token rows [T, 1, D/2] on the eager path; the whole cache [max_pos, D/2] when fused."""
        qkv = self.qkv_proj(x)      # x may be QuantizedRows (Qwen3DecoderLayer)
        T = qkv.shape[0]
        k_cache, v_cache = kv_cache
        if self.fused:
            # One kernel norms and rotates q and k and stores k and v in the cache; attention reads it there.
            from llmserve_core.kernels.qk_norm_rope import qk_norm_rope_store
            q = qk_norm_rope_store(qkv, batch.positions, batch.slot_mapping, self.q_norm.weight, self.k_norm.weight,
                                   cos, sin, self.q_norm.eps, self.num_heads, self.num_kv_heads, self.head_dim,
                                   k_cache, v_cache, self.k_scale, self.v_scale, pdl=self.pdl)
            # Where o_proj's W8A8 GEMM wants its rows quantized a scale per head, a decode hands them so.
            quant = _input_quant(self.o_proj, T, qkv.dtype)
            out = attn_backend.attend(q, k_cache, v_cache, batch, self.scale, k_scale=self.k_scale,
                                      v_scale=self.v_scale, pdl=self.pdl, quant=quant)
            if isinstance(out, tuple):
                return self._o_proj(QuantizedRows(*out, quant, T, qkv.dtype))
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = RotaryEmbedding.apply(self.q_norm(q.view(T, self.num_heads, self.head_dim)), cos, sin)
            k = RotaryEmbedding.apply(self.k_norm(k.view(T, self.num_kv_heads, self.head_dim)), cos, sin)
            out = attn_backend.forward(q, k, v.view(T, self.num_kv_heads, self.head_dim), k_cache, v_cache, batch,
                                       self.scale, k_scale=self.k_scale, v_scale=self.v_scale)
        return self._o_proj(out.reshape(T, self.q_size))

    def _o_proj(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        out = self.o_proj(x)
        return out if self.tp is None else self.tp.all_reduce(out)


class Qwen3MLP(nn.Module):
    fused = False   # set by Qwen3ForCausalLM on CUDA: SiLU-and-mul as one Triton kernel
    pdl = False     # ... launched under PDL on Hopper

    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        # Under tensor parallelism this rank holds a slice of the intermediate features: down_proj's product
        # is a partial sum, all-reduced here as o_proj's is.
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.tp = tp

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x may be QuantizedRows (Qwen3DecoderLayer)."""
        out = self._fused(x) if self.fused else self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _fused(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        rows = x.rows if isinstance(x, QuantizedRows) else x.shape[0]
        quant = _input_quant(self.down_proj, rows, x.dtype)       # x.dtype: the model's, as QuantizedRows keep it
        if quant is None and self.gate_up_proj.folds_silu_mul(rows):
            # A decode's GEMV ends in the SiLU-and-mul (kernels/silu_mul.gated_rows): one launch and one
            # link of the PDL chain fewer, where down_proj takes its rows as they are.
            return self.down_proj(self.gate_up_proj(x, silu_mul=True))
        from llmserve_core.kernels.silu_mul import silu_mul
        gate_up = self.gate_up_proj(x)
        act = silu_mul(gate_up, pdl=self.pdl, quant=quant)
        return self.down_proj(act if quant is None else QuantizedRows(*act, quant, rows, gate_up.dtype))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp=None, mlp: nn.Module | None = None):
        """mlp: the layer's MLP, a dense Qwen3MLP unless given (a Qwen3-MoE sparse layer's experts)."""
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, tp)
        self.mlp = Qwen3MLP(cfg, tp) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, cos, sin, kv_cache, batch, attn_backend):
        """(h, residual) -> (h, residual); the layer's input stream is h + residual (just h at layer 0).
        A norm hands its FP8 projection the rows quantized where that projection asks for them so."""
        rows = h.shape[0]
        quant = _input_quant(self.self_attn.qkv_proj, rows, h.dtype)
        if residual is None:
            residual, h = h, self.input_layernorm(h, quant=quant)
        else:
            h, residual = self.input_layernorm(h, residual, quant=quant)
        h = self.self_attn(h, cos, sin, kv_cache, batch, attn_backend)
        # Another MLP (layers/moe.py's) takes its rows as they are.
        mlp_in = self.mlp.gate_up_proj if isinstance(self.mlp, Qwen3MLP) else None
        h, residual = self.post_attention_layernorm(h, residual, quant=_input_quant(mlp_in, rows, h.dtype))
        if mlp_in is None:      # the MoE router leaves a graph's padding rows out (ForwardBatch.live_rows)
            return self.mlp(h, live_rows=batch.live_rows), residual
        return self.mlp(h), residual


def _input_quant(proj, rows: int, dtype: torch.dtype) -> RowQuant | None:
    return proj.input_quant(rows, dtype) if isinstance(proj, Fp8Linear) else None


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp=None, make_mlp=None):
        """make_mlp(layer) -> that decoder layer's MLP; None: every layer's a dense Qwen3MLP."""
        super().__init__()
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None else
                             VocabParallelEmbedding(tp.shard.vocab[1], cfg.hidden_size, tp.shard.vocab[0], tp))
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, tp, None if make_mlp is None else make_mlp(i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend, dtype: torch.dtype, device, max_positions: int | None = None,
                 fp8: Fp8Scheme | None = None, tp=None):
        """tp: a distributed.group.TPGroup; cfg is then this rank's shard (ShardSpec.local_config)."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.attn_backend = attn_backend
        # Build on the meta device and allocate uninitialized storage once: no throwaway random init,
        # which for an 8B model would cost more than loading the checkpoint.
        with torch.device("meta"):
            self.model = Qwen3Model(cfg, tp, self.make_mlp)
            vocab_rows = cfg.vocab_size if tp is None else tp.shard.vocab[1]
            # A Qwen3Model checkpoint (an embedding model) has no head at all: only pooling reads it.
            self.has_head = not cfg.pooling_only
            self.lm_head = None if cfg.tie_word_embeddings or not self.has_head else Linear(cfg.hidden_size, vocab_rows)
        self.to(dtype)
        if fp8 is not None:        # after the cast, which would widen FP8 weights to dtype
            apply_fp8(self, cfg, fp8)
        self.to_empty(device=device)
        self.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_context_len, cfg.rope_theta,
                                      cfg.rope_scaling, cfg.max_position_embeddings, dtype, device)
        # On CUDA with a fast attention backend, norms, q/k-norm+rotary+K/V store and SiLU-and-mul run as Triton
        # kernels: at decode sizes launch latency, not arithmetic, is what the eager versions cost.
        # The torch backend keeps the whole model eager, as the reference.
        chain = use_pdl(device, attn_backend)
        self.set_fused(fast_path(device, attn_backend), chain=chain, pdl=chain)

    def make_mlp(self, layer: int) -> nn.Module:
        """Decoder layer `layer`'s MLP (models/qwen3_moe.py gives the sparse layers their experts)."""
        return Qwen3MLP(self.cfg, self.tp)

    def set_fused(self, fused: bool, chain: bool = False, pdl: bool = False) -> None:
        """Switch every module between its Triton kernels and its eager torch ops (tests run the fused
        path on the CPU, in Triton's interpreter, against the eager one). chain: a batch-1 decode layer's
        projections stream through kernels/stream_gemv.py; pdl: every kernel of the layer launches under
        PDL (the model turns both on together on Hopper; the CPU tests run the chain without PDL). Both
        need `fused`."""
        self.fused = fused
        chain, pdl = fused and chain, fused and chain and pdl
        for m in self.model.modules():
            if isinstance(m, (RMSNorm, Qwen3Attention, Qwen3MLP, Fp8Linear)):
                m.fused = fused
            if isinstance(m, (Linear, Fp8Linear)):
                m.fast_kernel = "stream" if chain else None
            if isinstance(m, Linear):
                m.cublaslt_rows = m.cublaslt_max_rows() if fused else 0
            if isinstance(m, (RMSNorm, Qwen3Attention, Qwen3MLP, Linear, Fp8Linear)):
                m.pdl = pdl
        if self.lm_head is not None:
            self.lm_head.fast_kernel = "gemv" if fused else None   # kernels.gemv beats cuBLAS on the 152k rows

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: list[KVCache],
                aux_layer_ids: tuple[int, ...] = ()):
        """input_ids [T] -> final-normed hidden [T, H], plus the aux hidden states when aux_layer_ids is given.

        Aux hidden state i (what EAGLE-3 feeds its draft head, as vLLM's aux_hidden_state_layers) is the
        residual stream entering decoder layer i, before its input norm: the embeddings for i = 0, else
        the un-normed output of layer i - 1 (transformers' output_hidden_states[i]). Returned in the order
        of aux_layer_ids.
        """
        num_layers = len(self.model.layers)
        for i in aux_layer_ids:
            if not 0 <= i < num_layers:
                raise ValueError(f"aux_layer_ids: layer {i} out of range [0, {num_layers})")
        if len(kv_caches) != num_layers:
            raise ValueError(f"kv_caches: expected {num_layers} (k_cache, v_cache) pairs, got {len(kv_caches)}")
        if index_checks.ENABLED:
            index_checks.check_forward("the model's forward", batch, input_ids, kv_caches[0][0],
                                       self.cfg.vocab_size if self.tp is None else 0, self.rotary.cos.shape[0])
        cos, sin = (self.rotary.cos, self.rotary.sin) if self.fused else self.rotary.cos_sin(batch.positions)
        h, residual = self.model.embed_tokens(input_ids), None
        aux = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layer_ids:
                aux[i] = h if residual is None else h + residual
            h, residual = layer(h, residual, cos, sin, kv_caches[i], batch, self.attn_backend)
        h, _ = self.model.norm(h, residual)
        if aux_layer_ids:
            return h, [aux[i] for i in aux_layer_ids]
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (rows already selected) -> float32 logits [N, vocab]."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden, out_dtype=torch.float32)
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax over the vocabulary, int64 [N], without float32 logits: up to MAX_ROWS rows
        straight from the lm_head's kernel (kernels.gemv.gemv_argmax: the logits are never written), more
        rows as the argmax of the model-dtype logits (widening them is exact, so this is the float32
        logits' argmax, ties included, without the widened copy). None where the model's logits must be
        taken (the fast path off: the eager reference; a vocabulary split over ranks)."""
        if not self.fused or self.tp is not None or hidden.shape[0] == 0:
            return None
        if hidden.shape[0] <= MAX_ROWS and hidden.stride(-1) == 1:
            from llmserve_core.kernels.gemv import gemv_argmax
            return gemv_argmax(hidden, self.lm_head_weight)
        return F.linear(hidden, self.lm_head_weight).argmax(-1)

    def vocab_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding, head) over the whole vocabulary, for the draft model to share. Under tensor
        parallelism they are gathered from every rank's slice: a collective, so every rank calls it."""
        embed, head = self.model.embed_tokens.weight, self.lm_head_weight
        if self.tp is None:
            return embed, head
        full_embed = self.tp.gather_vocab_rows(embed)
        return full_embed, (full_embed if head is embed else self.tp.gather_vocab_rows(head))
