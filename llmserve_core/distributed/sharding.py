"""Which slice of every Qwen3 (and Qwen3-MoE) weight a tensor-parallel rank holds.

Attention heads, the MLP's intermediate columns and the vocabulary are split in contiguous ranges.
KV heads are split too where there are at least as many as ranks; with fewer, each KV head is
replicated on the ranks whose query heads read it (rank r holds KV head r * num_kv_heads // size).
A MoE layer's experts are split as the dense MLP is, each expert's intermediate columns over the ranks;
with expert parallelism (vLLM's --enable-expert-parallel) each rank holds whole experts instead, a
contiguous range of them, and its router masks the others (layers/moe.py).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from llmserve_core.models.config import ModelConfig


# A MoE expert's projections in the checkpoint (models/moe_loading.py names stacked pieces the same way).
_EXPERT_PROJ = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.")


def check_divisible(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise ValueError naming tensor_parallel_size when the model cannot be split `size` ways."""
    def fail(what: str):
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {what}")
    if cfg.num_attention_heads % size:
        fail(f"{cfg.num_attention_heads} attention heads")
    kv = cfg.num_key_value_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        fail(f"{kv} KV heads (nor do they divide it)")
    sparse = [cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers)]
    if not all(sparse) and cfg.intermediate_size % size:
        fail(f"intermediate size {cfg.intermediate_size}")
    if any(sparse):
        if expert_parallel and cfg.num_experts % size:
            fail(f"{cfg.num_experts} experts (expert parallelism places whole experts on each rank)")
        if not expert_parallel and cfg.moe_intermediate_size % size:
            fail(f"experts' intermediate size {cfg.moe_intermediate_size} (--enable-expert-parallel places "
                 f"whole experts instead)")


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    size: int
    q_heads: tuple[int, int]        # (first, count) of the query heads this rank holds
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]   # (first, count) of the MLP's intermediate columns
    vocab: tuple[int, int]          # (first, count) of the vocabulary rows; count is padded, equal on every rank
    vocab_size: int                 # the unpadded full vocabulary
    experts: tuple[int, int] = (0, 0)           # (first, count) of a MoE layer's experts this rank holds
    moe_intermediate: tuple[int, int] = (0, 0)  # (first, count) of each of those experts' intermediate columns

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False) -> "ShardSpec":
        check_divisible(cfg, size, expert_parallel)
        nq = cfg.num_attention_heads // size
        kv = cfg.num_key_value_heads
        kv_heads = (rank * (kv // size), kv // size) if kv >= size else (rank * kv // size, 1)
        ni = cfg.intermediate_size // size
        nv = -(-cfg.vocab_size // size)
        if expert_parallel:
            ne = cfg.num_experts // size
            experts, moe_intermediate = (rank * ne, ne), (0, cfg.moe_intermediate_size)
        else:
            nm = cfg.moe_intermediate_size // size
            experts, moe_intermediate = (0, cfg.num_experts), (rank * nm, nm)
        return cls(rank, size, (rank * nq, nq), kv_heads, (rank * ni, ni), (rank * nv, nv), cfg.vocab_size,
                   experts, moe_intermediate)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape this rank's layers have: its heads and intermediate columns, its experts' columns
        (vocabulary and the router's experts stay full: the runner samples over the whole vocabulary, the
        model's embedding and head know their own slice, the MoE layer its own experts)."""
        return dataclasses.replace(cfg, num_attention_heads=self.q_heads[1], num_key_value_heads=self.kv_heads[1],
                                   intermediate_size=self.intermediate[1],
                                   moe_intermediate_size=self.moe_intermediate[1])

    def _weight_ranges(self, hf_name: str, cfg: ModelConfig) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """(rows, cols) as (first, count) of a decoder linear's weight this rank holds: rows for the
        column-parallel q/k/v and gate/up, columns for the row-parallel o_proj and down; (None, None) else."""
        d = cfg.head_dim
        if m := _EXPERT_PROJ.search(hf_name):     # whole experts under expert parallelism: (first, all)
            part = None if self.moe_intermediate[1] == cfg.moe_intermediate_size else self.moe_intermediate
            return (part, None) if m.group(1) != "down" else (None, part)
        if ".self_attn.q_proj." in hf_name:
            return (self.q_heads[0] * d, self.q_heads[1] * d), None
        if ".self_attn.k_proj." in hf_name or ".self_attn.v_proj." in hf_name:
            return (self.kv_heads[0] * d, self.kv_heads[1] * d), None
        if ".self_attn.o_proj." in hf_name:
            return None, (self.q_heads[0] * d, self.q_heads[1] * d)
        if ".mlp.gate_proj." in hf_name or ".mlp.up_proj." in hf_name:
            return self.intermediate, None
        if ".mlp.down_proj." in hf_name:
            return None, self.intermediate
        return None, None

    def slice_checkpoint(self, hf_name: str, tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's part of checkpoint tensor `hf_name` (full-model config `cfg`); `tensor` is a
        safetensors slice or a tensor, read only where it is indexed."""
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            first, count = self.vocab
            part = tensor[first:min(first + count, self.vocab_size)]
            pad = count - part.shape[0]          # the last ranks' padding rows: zeros, cut from the logits
            return torch.cat([part, part.new_zeros(pad, part.shape[1])]) if pad else part
        rows, cols = self._weight_ranges(hf_name, cfg)
        if rows is not None:
            return tensor[rows[0]:rows[0] + rows[1]]
        if cols is not None:
            return tensor[:, cols[0]:cols[0] + cols[1]]
        return tensor[:]                          # norms: replicated

    def slice_weight_scale(self, hf_name: str, scale: torch.Tensor, cfg: ModelConfig,
                           block: tuple[int, int] | None) -> torch.Tensor:
        """This rank's part of an FP8 weight's scale `hf_name`. One per tensor: whole. One per output row:
        the rank's rows where the layer splits its rows, all of them where it splits K (each row's scale
        covers the whole row). One per bn x bk block: the rank's whole blocks, so its slice of the weight
        must start on a block edge."""
        rows, cols = self._weight_ranges(hf_name, cfg)
        if scale.numel() == 1 or (rows is None and (cols is None or block is None)):
            return scale
        if block is None:
            return scale[rows[0]:rows[0] + rows[1]]
        (first, count), side, axis = (rows, block[0], 0) if rows is not None else (cols, block[1], 1)
        if first % side:
            raise ValueError(f"tensor_parallel_size: {self.size} ranks split {hf_name!r}'s {side}-wide scale "
                             f"blocks (rank {self.rank}'s {'rows' if axis == 0 else 'columns'} start at {first})")
        return scale.narrow(axis, first // side, -(-count // side))
