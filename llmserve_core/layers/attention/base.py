"""The attention backend interface: store this step's K/V into the paged cache, then attend.

KV cache layout, shared by every backend and the block manager's slot arithmetic:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
(the layout of FlashAttention's paged API), one pair per layer.

On the fast path the model hands attention the qkv projection's packed rows (`attend_qkv`): by default
one kernel norms and rotates q and k and writes K/V into the cache (kernels/qk_norm_rope.py), then
`attend` runs; a backend whose decode kernel does that work itself overrides it for decode steps.
`forward` is the unfused path (CPU, the torch reference): the torch store, then `attend`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve_core.kernels.attention_reference import store_kv_reference
from llmserve_core.layers.batch import ForwardBatch


@dataclass(frozen=True)
class QKPrep:
    """What turns a layer's packed qkv rows into attention's inputs: Qwen3's per-head q/k RMSNorm (weights
    None: none, as in an EAGLE-3 draft), neox rotary over the whole cos / sin tables [max_positions, D / 2]
    at batch.positions, and the store of K/V at batch.slot_mapping."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    eps: float


class AttentionBackend:
    name: str

    def attend(
        self,
        q: torch.Tensor,        # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's K/V stored
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        k_scale: float = 1.0,   # an FP8 cache holds k / k_scale and v / v_scale; other caches ignore both
        v_scale: float = 1.0,
        pdl: bool = False,      # a Triton decode may launch under PDL (kernels/pdl.py); others ignore it
    ) -> torch.Tensor:          # [T, num_heads, head_dim]
        raise NotImplementedError

    def attend_qkv(self, qkv: torch.Tensor, prep: QKPrep, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   batch: ForwardBatch, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                   pdl: bool = False) -> torch.Tensor:
        """The fast path's attention from qkv [T, (Hq + 2 Hk) * D]: q/k norm + rotary + the K/V store in one
        kernel, then `attend`. pdl: both kernels launch under PDL (their wrappers say what that asks)."""
        from llmserve_core.kernels.qk_norm_rope import qk_norm_rope_store
        q = qk_norm_rope_store(qkv, batch.positions, batch.slot_mapping, prep.q_weight, prep.k_weight, prep.cos,
                               prep.sin, prep.eps, prep.num_heads, prep.num_kv_heads, prep.head_dim, k_cache,
                               v_cache, k_scale, v_scale, pdl=pdl)
        return self.attend(q, k_cache, v_cache, batch, scale, k_scale, v_scale, pdl=pdl)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """k, v: [T, num_kv_heads, head_dim], stored at batch.slot_mapping before attending. The store
        indexes with a mask (a host sync): the unfused path is not for CUDA graphs."""
        store_kv_reference(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        return self.attend(q, k_cache, v_cache, batch, scale, k_scale, v_scale)
