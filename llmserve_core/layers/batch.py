"""The one typed object that carries a step's token layout from the model runner to the layers.

The runner builds a ForwardBatch per forward; every attention backend reads the same fields.
Tokens of all sequences are packed into one flat dimension T (no padding between sequences):
sequence i owns query rows query_start_loc[i] : query_start_loc[i + 1], which are its last
(query_len) positions; its first seq_lens[i] - query_len positions are already in the KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    positions: torch.Tensor        # [T] int64, absolute position of each packed token
    slot_mapping: torch.Tensor     # [T] int64, KV cache slot (block * block_size + offset) to write, -1 = skip
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor         # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor     # [B, max_blocks_per_seq] int32, physical block ids, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies of the per-sequence lengths, so backends that loop on the host never sync the GPU.
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # Optional extra mask among the query tokens of each sequence (speculative tree verify):
    # [T, max_query_len] bool, row t says which query tokens of its own sequence token t may see,
    # on top of the whole cached prefix. None means plain causal.
    tree_mask: torch.Tensor | None = None
    # When every sequence brings the same number R of query rows (a verify of 1 + gamma rows, a padded
    # draft catch-up, a decode), R; else 0. Attention may then run these rows through its decode kernel.
    uniform_query_len: int = 0
    # [1] int32 on the device: how many rows are live, those after them a CUDA graph's padding (their ids
    # and slots are placeholders, their outputs dropped). The MoE router sends padding rows to no expert, so
    # a padded decode step reads no expert weights for them. None: every row is live.
    live_rows: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token (the CUDA-graph and flash-decoding case)."""
        return self.max_query_len == 1 and self.tree_mask is None
