"""The torch reference for paged attention: every attention kernel and backend is tested against it,
and the torch backend runs it.

Loops over sequences on the host, gathers each one's context through its block table and runs plain
softmax attention in float32. Slow, obvious, and correct on CPU and CUDA. Layout as in the kernels:
q [T, H, D] packed by sequence, caches [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import torch

from llmserve_core.kernels.fp8_format import to_cache_dtype


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]          # [nb, bs, kvh, d]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def from_cache(cached: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached K or V rows in float32: an FP8 cache holds x / scale."""
    return cached.float() * scale if cached.dtype == torch.float8_e4m3fn else cached.float()


def paged_attention_reference(q, k_cache, v_cache, seq_lens, block_tables, scale, query_start_loc=None,
                              tree_mask=None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its cached context (already stored).

    seq_lens: per sequence, context length after this step (tensor or host list). query_start_loc: [B + 1]
    cumulative query lengths (tensor or list); None means one query row per sequence (decode). Query row j
    of a sequence sits at position seq_len - q_len + j and sees every key up to it; tree_mask
    ([T, max_query_len] bool), when given, decides visibility among the step's own tokens instead.
    k_scale / v_scale: the per-tensor scales of an FP8 cache."""
    seq_lens = _as_list(seq_lens)
    qsl = list(range(len(seq_lens) + 1)) if query_start_loc is None else _as_list(query_start_loc)
    num_heads = q.shape[1]
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, q_len = qsl[i], qsl[i + 1] - qsl[i]
        if q_len == 0 or seq_len == 0:
            continue
        qi = q[start:start + q_len].float()                    # [q, H, D]
        ki = from_cache(gather_context(k_cache, block_tables[i], seq_len), k_scale)
        vi = from_cache(gather_context(v_cache, block_tables[i], seq_len), v_scale)
        group = num_heads // ki.shape[1]
        ki = ki.repeat_interleave(group, dim=1)                 # [s, H, D]
        vi = vi.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", qi, ki) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        if tree_mask is not None:
            # Among this step's own tokens, the tree decides; the cached prefix stays fully visible.
            allowed[:, seq_len - q_len:] = tree_mask[start:start + q_len, :q_len]
        probs = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
        out[start:start + q_len] = torch.einsum("hqs,shd->qhd", probs, vi).to(q.dtype)
    return out


def store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each token's K/V into its cache slot; slot -1 marks a token that must not be stored. An FP8
    cache stores x / scale, saturated."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(k[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = to_cache_dtype(v[keep], v_cache.dtype, v_scale)
