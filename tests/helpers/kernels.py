"""Random inputs and error measures for the kernel tests (each kernel against its torch reference)."""
from __future__ import annotations

import torch

from helpers.batch import allocate_tables

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 4e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output holds NaN (an unwritten element or a bad mask)"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def gemv_inputs(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return x.to(dtype=dtype, device=DEVICE), w.to(dtype=dtype, device=DEVICE)


def paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen):
    """Random K/V caches and block tables whose blocks are scattered (and block 0 unused)."""
    tables, num_blocks = allocate_tables([max(1, s) for s in seq_lens], block_size)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = [[int(perm[b - 1]) for b in t] for t in tables]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    vc = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    return kc, vc, bt


def prefill_case(query_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed,
                 tree=False):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, ctx_lens)]
    kc, vc, bt = paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    tree_mask = None
    if tree:
        tree_mask = torch.zeros(sum(query_lens), max(query_lens), dtype=torch.bool)
        start = 0
        for n in query_lens:
            # A random tree: each token sees some earlier tokens of its sequence and always itself.
            m = torch.tril(torch.rand(n, n, generator=gen) < 0.5) | torch.eye(n, dtype=torch.bool)
            tree_mask[start:start + n, :n] = m
            start += n
        tree_mask = tree_mask.to(device)
    return q, kc, vc, bt, qsl, lens, tree_mask
