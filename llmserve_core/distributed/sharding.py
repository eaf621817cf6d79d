"""Which slice of every Qwen3 weight a tensor-parallel rank holds.

Attention heads, the MLP's intermediate columns and the vocabulary are split in contiguous ranges.
KV heads are split too where there are at least as many as ranks; with fewer, each KV head is
replicated on the ranks whose query heads read it (rank r holds KV head r * num_kv_heads // size).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmserve_core.models.config import ModelConfig


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming tensor_parallel_size when the model cannot be split `size` ways."""
    def fail(what: str):
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {what}")
    if cfg.num_attention_heads % size:
        fail(f"{cfg.num_attention_heads} attention heads")
    kv = cfg.num_key_value_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        fail(f"{kv} KV heads (nor do they divide it)")
    if cfg.intermediate_size % size:
        fail(f"intermediate size {cfg.intermediate_size}")


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    size: int
    q_heads: tuple[int, int]        # (first, count) of the query heads this rank holds
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]   # (first, count) of the MLP's intermediate columns
    vocab: tuple[int, int]          # (first, count) of the vocabulary rows; count is padded, equal on every rank
    vocab_size: int                 # the unpadded full vocabulary

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> "ShardSpec":
        check_divisible(cfg, size)
        nq = cfg.num_attention_heads // size
        kv = cfg.num_key_value_heads
        kv_heads = (rank * (kv // size), kv // size) if kv >= size else (rank * kv // size, 1)
        ni = cfg.intermediate_size // size
        nv = -(-cfg.vocab_size // size)
        return cls(rank, size, (rank * nq, nq), kv_heads, (rank * ni, ni), (rank * nv, nv), cfg.vocab_size)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape this rank's layers have: its heads and intermediate columns (vocabulary stays full:
        the runner samples over all of it, the model's embedding and head know their own slice)."""
        return dataclasses.replace(cfg, num_attention_heads=self.q_heads[1], num_key_value_heads=self.kv_heads[1],
                                   intermediate_size=self.intermediate[1])

    def slice_checkpoint(self, hf_name: str, tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's part of checkpoint tensor `hf_name` (full-model config `cfg`); `tensor` is a
        safetensors slice or a tensor, read only where it is indexed."""
        d = cfg.head_dim
        rows = cols = None
        if ".self_attn.q_proj." in hf_name:
            rows = (self.q_heads[0] * d, self.q_heads[1] * d)
        elif ".self_attn.k_proj." in hf_name or ".self_attn.v_proj." in hf_name:
            rows = (self.kv_heads[0] * d, self.kv_heads[1] * d)
        elif ".self_attn.o_proj." in hf_name:
            cols = (self.q_heads[0] * d, self.q_heads[1] * d)
        elif ".mlp.gate_proj." in hf_name or ".mlp.up_proj." in hf_name:
            rows = self.intermediate
        elif ".mlp.down_proj." in hf_name:
            cols = self.intermediate
        elif hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            first, count = self.vocab
            part = tensor[first:min(first + count, self.vocab_size)]
            pad = count - part.shape[0]          # the last ranks' padding rows: zeros, cut from the logits
            return torch.cat([part, part.new_zeros(pad, part.shape[1])]) if pad else part
        if rows is not None:
            return tensor[rows[0]:rows[0] + rows[1]]
        if cols is not None:
            return tensor[:, cols[0]:cols[0] + cols[1]]
        return tensor[:]                          # norms: replicated
