"""Two candidate kernels for the decoder's projections at 64 rows, against cuBLAS (H200, Qwen3-8B shape, bf16).

kernels/gemv.py's layout (the weight tile as the dot's wide operand) lost to cuBLAS at 64 rows
(benchmarks/skinny_gemm_bench.py). Tried here, each alone over its tiles (CUDA graphs, weights larger than
L2, plain and under PDL) and in a decode layer's chain of launches without attention (8 layers, the small
kernels under PDL):
  xa        x as the dot's A operand (64 rows, wgmma's natural M), narrow weight column blocks (32-128),
            deep cp.async pipelines, split-K merged in the same launch (gemv.store_split_k);
  prefetch  the gemv layout with the next weight tile prefetched in registers, the first one loaded
            before the PDL wait (as kernels/stream_gemv.py does at one row).
Outcome at 6f7ec1a (benchmarks/results/skinny_gemm_candidates_h200_6f7ec1a.json): xa ties cuBLAS (chain
121.7 against 122.8 us a layer), prefetch loses (151 us); neither went into the engine.

    python benchmarks/skinny_gemm_candidates.py $OUT/candidates.json
"""
import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemv_bench import SHAPES, bench, graph_us  # noqa: E402
from pdl_chain_bench import layer_chain  # noqa: E402
from llmserve_core.kernels.gemv import _SCRATCH, store_split_k  # noqa: E402
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release  # noqa: E402


@triton.jit(do_not_specialize=["M"])
def _xa_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_y, k_per_split,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
               PDL: tl.constexpr):
    pdl_wait_and_release(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_x
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + rk
        xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
        acc = tl.dot(xv, tl.trans(w), acc)
    y_ptrs = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
    store_split_k(tl.trans(acc), y_ptrs, n_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, pid_n, pid_k, M,
                  BLOCK_M, BLOCK_N, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def _prefetch_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_y, k_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_x
    k_lo = pid_k * k_per_split
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + k_lo + rk[None, :]
    w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)      # before the wait: no kernel before writes W
    pdl_wait_and_release(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        nxt = k0 + BLOCK_K
        w_next = tl.load(w_ptrs + (nxt - k_lo), mask=n_mask[:, None] & (nxt < k_lo + k_per_split), other=0.0)
        xv = tl.load(x_rows + (k0 + rk)[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(xv), acc)
        w = w_next
    y_ptrs = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
    store_split_k(acc, y_ptrs, n_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, pid_n, pid_k, M,
                  BLOCK_M, BLOCK_N, SPLIT_K)


def candidate_gemv(kind, x, w, cfg, pdl=False):
    m, k = x.shape
    n = w.shape[0]
    cfg = dict(cfg)
    bn, split = cfg["BLOCK_N"], cfg.pop("SPLIT_K")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    n_blocks = triton.cdiv(n, bn)
    k_per_split = k // split
    parts, counts = _SCRATCH.get(x.device, n_blocks * split * bn * cfg["BLOCK_M"] if split > 1 else 0,
                                 n_blocks if split > 1 else 0)
    kern = _xa_kernel if kind == "xa" else _prefetch_kernel
    kern[(n_blocks, split)](x, w, y, parts, counts, m, n, k, x.stride(0), y.stride(0), k_per_split, SPLIT_K=split,
                            PDL=pdl, **cfg, **pdl_launch(pdl))
    return y


def candidate_tiles(kind, n, k):
    out = []
    for bn in ((32, 64, 128) if kind == "xa" else (64, 128)):
        for bk in (64, 128):
            for split in (1, 2, 4, 8):
                programs = -(-n // bn) * split
                if k % (split * bk) or programs < 132 or programs > 8 * 132:
                    continue
                for warps in (4, 8):
                    for stages in ((4, 6, 8) if kind == "xa" else (1,)):
                        if kind == "xa" and bn * bk * 2 * stages + 64 * bk * 2 * stages > 200 * 1024:
                            continue
                        out.append(dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                                        num_stages=stages))
    return out



PROJ = ("qkv", "o_proj", "gate_up", "down")

def _compile(jobs):
    for kind, n, k, cfg, pdl in jobs:
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16); w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        try: candidate_gemv(kind, x, w, cfg, pdl)
        except Exception as e: print("cskip", kind, cfg, type(e).__name__, str(e)[:60], flush=True)
    torch.cuda.synchronize(); return 0

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", metavar="OUT.json", help="JSON file to write")
    args = ap.parse_args()
    jobs = [(kind, *SHAPES[p], cfg, pdl) for p in PROJ for kind in ("xa", "prefetch") for cfg in candidate_tiles(kind, *SHAPES[p]) for pdl in (False, True)]
    t = time.time()
    with mp.get_context("spawn").Pool(14) as pool: pool.map(_compile, [jobs[i::14] for i in range(14)])
    print("compiled", len(jobs), time.time() - t, flush=True)
    res = {}
    best = {}
    for p in PROJ:
        n, k = SHAPES[p]
        copies = max(3, -(-256 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        cub = 1e3 * bench(lambda i: F.linear(x, ws[i]), copies)
        for kind in ("xa", "prefetch"):
            rows = []
            for cfg in candidate_tiles(kind, n, k):
                try:
                    y = candidate_gemv(kind, x, ws[0], cfg)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, err
                    us = 1e3 * bench(lambda i: candidate_gemv(kind, x, ws[i], cfg), copies, replays=5)
                    usp = 1e3 * bench(lambda i: candidate_gemv(kind, x, ws[i], cfg, True), copies, replays=5)
                    rows.append((cfg, us, usp))
                except Exception as e:
                    print("skip", p, kind, cfg, type(e).__name__, str(e)[:80], flush=True)
            rows.sort(key=lambda r: min(r[1], r[2]))
            res[f"{p}_{kind}"] = rows
            best[(p, kind)] = rows[0][0]
            print(f"{p:8s} {kind:8s} cublas {cub:.1f} us ({n*k*2/cub/1e6:.2f} TB/s) | " + " | ".join(
                f"{c['BLOCK_N']}x{c['BLOCK_K']} s{c['SPLIT_K']} w{c['num_warps']} st{c['num_stages']}: {u:.1f}/{up:.1f}" for c, u, up in rows[:4]), flush=True)
        del ws; torch.cuda.empty_cache()
    # chain at 64 rows: cublas vs each kind under PDL with its best tiles
    h = 4096
    layers = [{"w": {p: torch.randn(*SHAPES[p], device="cuda", dtype=torch.bfloat16) * SHAPES[p][1] ** -0.5 for p in PROJ},
               "n1": torch.rand(h, device="cuda", dtype=torch.bfloat16) + .5, "n2": torch.rand(h, device="cuda", dtype=torch.bfloat16) + .5} for _ in range(8)]
    h0 = torch.randn(64, h, device="cuda", dtype=torch.bfloat16)
    def run(kind, pdl):
        lin = ((lambda x, L, p: F.linear(x, L["w"][p])) if kind == "cublas" else
               (lambda x, L, p: candidate_gemv(kind, x, L["w"][p], best[(p, kind)], pdl)))
        return layer_chain(h0, layers, lin, pdl=pdl)

    chain = {}
    refc = run("cublas", False)
    for kind, pdl in (("cublas", False), ("xa", False), ("xa", True), ("prefetch", False), ("prefetch", True)):
        us, c = graph_us(lambda: run(kind, pdl), len(layers))
        err = ((c.float() - refc.float()).norm() / refc.float().norm()).item()
        chain[f"{kind}_pdl{int(pdl)}"] = (us, err)
        print("chain m64", kind, pdl, f"{us:.1f} us/layer err {err:.3g}", flush=True)
    json.dump({"sweep": res, "chain": chain}, open(args.out, "w"), indent=1, default=str)
