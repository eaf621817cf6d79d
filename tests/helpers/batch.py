"""Test-only builders for a ForwardBatch and a paged KV cache, standing in for the model runner."""
from __future__ import annotations

import torch

from llmserve_core.layers.batch import ForwardBatch


def make_kv_caches(cfg, num_blocks: int, block_size: int, dtype=torch.float32, device="cpu"):
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)]


def make_batch(seqs: list[tuple[int, int]], block_tables: list[list[int]], block_size: int,
               device="cpu") -> ForwardBatch:
    """seqs[i] = (tokens already cached, new tokens this step); block_tables[i] covers both."""
    positions, slots = [], []
    for (cached, new), table in zip(seqs, block_tables):
        for pos in range(cached, cached + new):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    query_lens = [new for _, new in seqs]
    seq_lens = [cached + new for cached, new in seqs]
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    return ForwardBatch(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def allocate_tables(total_lens: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Disjoint block tables for sequences of the given final lengths, handed out interleaved so a
    sequence's blocks are not contiguous (as after real allocation churn). Returns (tables, num_blocks)."""
    need = [(n + block_size - 1) // block_size for n in total_lens]
    tables: list[list[int]] = [[] for _ in total_lens]
    next_block = 1  # block 0 stays unused so padding entries never alias real data
    for round_ in range(max(need)):
        for i, n in enumerate(need):
            if round_ < n:
                tables[i].append(next_block)
                next_block += 1
    return tables, next_block


def prefill_then_decodes(cfg, lens: list[int], block_size: int, decodes: int = 2, seed: int = 5):
    """(KV blocks they need, [(ids, batch)]): a packed prefill of random prompts of `lens`, then `decodes`
    one-token steps of each, over interleaved block tables."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
    tables, num_blocks = allocate_tables([n + decodes for n in lens], block_size)
    steps = [(torch.cat(prompts), make_batch([(0, n) for n in lens], tables, block_size))]
    steps += [(torch.tensor([5 + i + 13 * j for j in range(len(lens))]),
               make_batch([(n + i, 1) for n in lens], tables, block_size)) for i in range(decodes)]
    return num_blocks, steps
