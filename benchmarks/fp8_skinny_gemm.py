"""FP8 projections at 17-256 rows (a decode batch past the GEMV's always-on 16 rows; any 1-1,024 with --rows),
per-channel or 128 x 128 block-scaled (`--scales`): what the engine ran there before kernels/fp8_gemv.py took
17-64 rows (x quantized in a launch of its own, then cuBLAS's FP8 GEMM through torch._scaled_mm, "engine"),
its two halves alone, Triton W8A8 tiles, and the "a8" GEMV kernel with 16- to 128-row x tiles, quantizing x
per 1 x 128 piece inside it ("a8") or reading x quantized ahead ("a8x", the GEMM alone: the RMSNorm or
SiLU-and-mul before it quantizes), against bf16's cuBLAS at the same rows. Where the tables name a GEMV tile for the rows (1-64), "gemv_table" times it
too: what the engine runs there now. Past the tables' rows the engine runs "scaled_mm" for qkv, gate_up and
down (the RMSNorm or the SiLU-and-mul before them quantizes x) and "engine" for o_proj.

At these row counts a Qwen3-8B projection is still bound by its weight's bytes on Hopper (64 rows x 2 FLOPs
per FP8 byte is under the FP8 ridge), so FP8 should take about half of bf16's time. Each arm is timed as a
CUDA graph of back-to-back calls over weight copies larger than L2, and checked against its float32
reference (the dequantized weight times x, quantized as that arm quantizes it) first.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/fp8_skinny_gemm.py --out $OUT/fp8_skinny.json   # ~1 min
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import llmserve_core.kernels.fp8_gemv as fp8_gemv_module  # noqa: E402
from llmserve_core.kernels.fp8_format import quantize_per_block, quantize_per_channel  # noqa: E402
from llmserve_core.kernels.fp8_gemm import (CUBLAS_BLOCK_ROWS, scaled_mm_supported,  # noqa: E402
                                             w8a8_block_linear, w8a8_gemm_per_channel, w8a8_gemm_reference,
                                             w8a8_gemm_triton)
from llmserve_core.kernels import tuned  # noqa: E402
from llmserve_core.kernels.fp8_gemv import choose, fp8_gemv, fp8_gemv_a8_reference, fp8_gemv_reference  # noqa: E402
from llmserve_core.kernels.stream_gemv import stream_gemv  # noqa: E402
from llmserve_core.kernels.fp8_quant import quantize_activation  # noqa: E402
from floor import measure_copy_bandwidth  # noqa: E402
from gemv_bench import bench  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (17, 32, 64, 128, 256)
SCALES = {"channel": None, "block": (128, 128)}
ROTATE_BYTES = 256 << 20      # FP8 weight bytes the copies of one shape span: several times the L2
# Triton W8A8 tiles (BLOCK_M, BLOCK_N, warps, stages) beside the engine's GPU_TILES entry
TRITON_TILES = ((16, 128, 4, 4), (32, 128, 4, 4), (32, 64, 4, 5), (64, 64, 4, 4))
# a8 GEMV tiles (BLOCK_N, BLOCK_K, warps, stages, K split) for 32- and 64-row x tiles, x quantized in the kernel
A8_TILES = ((128, 128, 8, 4, 4), (64, 128, 4, 3, 2))
# The same kernel on an x quantized ahead per 1 x 128 piece (as an RMSNorm before could emit it): (BLOCK_N,
# warps, stages) x K splits, BLOCK_K 128; x tiles of 32, 64 or 128 rows.
A8X_TILES = ((64, 4, 4), (128, 4, 4), (128, 8, 4), (64, 4, 6), (32, 2, 4))
A8X_SPLITS = (1, 2, 4, 8)
MAX_ROWS = 1024


def parse_rows(text: str) -> tuple[int, ...]:
    """'17,64' -> (17, 64): positive row counts up to MAX_ROWS, or a named error."""
    rows = []
    for part in text.split(","):
        try:
            m = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rows: {part!r} is not a whole number") from None
        if not 0 < m <= MAX_ROWS:
            raise argparse.ArgumentTypeError(f"--rows: {m} is outside 1..{MAX_ROWS}")
        rows.append(m)
    return tuple(rows)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def arms(m: int, n: int, k: int, block: tuple[int, int] | None, xq: tuple, xq128: tuple) -> dict:
    """label -> (call(x, w_bf16, q, s) -> y, the reference it matches: "bf16", "token" (x quantized as the
    engine's W8A8 path quantizes it: per token for per-channel weights, per 1 x 128 piece for block-scaled
    ones) or "pieceK" (per 1 x K piece); None: unchecked). xq: x quantized that way ahead, for the arm timing
    cuBLAS alone; xq128: per 1 x 128 piece, for the a8x arms (the GEMM alone: add quantize128)."""
    group = None if block is None else block[1]
    out = {"bf16": (lambda x, w, q, s: F.linear(x, w), "bf16"),
           "quantize": (lambda x, w, q, s: quantize_activation(x, group, m_major=block is not None,
                                                               pad_rows_to=1 if block is None else 4)[0], None)}
    if scaled_mm_supported(torch.device("cuda"), n, k, torch.bfloat16, block):
        if block is None:
            out["scaled_mm"] = (lambda x, w, q, s: torch._scaled_mm(
                xq[0], q.t(), scale_a=xq[1].view(-1, 1), scale_b=s.view(1, -1), out_dtype=torch.bfloat16), "token")
        else:
            out["scaled_mm"] = (lambda x, w, q, s: torch._scaled_mm(
                xq[0], q.t(), scale_a=xq[1], scale_b=s.t(), out_dtype=torch.bfloat16)[:m], "token")
    if block is None:
        out["engine"] = (lambda x, w, q, s: w8a8_gemm_per_channel(*quantize_activation(x), q, s, torch.bfloat16),
                         "token")
    else:
        out["engine"] = (lambda x, w, q, s: w8a8_block_linear(x, q, s, block, torch.bfloat16), "token")
    for bm, bn, warps, stages in TRITON_TILES:
        def triton_tile(x, w, q, s, t=(bm, bn, warps, stages)):
            a, a_s = quantize_activation(x, group)
            return w8a8_gemm_triton(a, a_s if block else a_s.view(-1, 1), q, s, block, torch.bfloat16,
                                    block_m=t[0], block_n=t[1], num_warps=t[2], num_stages=t[3])
        out[f"triton_m{bm}_n{bn}_w{warps}_s{stages}"] = (triton_tile, "token")
    table = choose(tuned.device_spec(torch.device("cuda")), m, n, k, block, stream=m == 1)
    if table is not None:       # the GEMV the engine runs at these rows (the stream kernel at one row)
        out["gemv_table"] = ((lambda x, w, q, s: stream_gemv(x, q, s, block, config=table.tile))
                             if table.kernel == "stream" else
                             (lambda x, w, q, s: fp8_gemv(x, q, s, block, kernel=table.kernel, config=table.tile)),
                             "stream" if table.kernel == "stream" else f"piece{table.tile['BLOCK_K']}")
    if m <= 64:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        for bn, bk, warps, stages, split in A8_TILES:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)
            out[f"a8_m{bm}_n{bn}_k{bk}_w{warps}_s{stages}_sk{split}"] = (
                lambda x, w, q, s, cfg=cfg: fp8_gemv(x, q, s, block, kernel="a8", config=cfg), f"piece{bk}")
    out["quantize128"] = (lambda x, w, q, s: quantize_activation(x, 128)[0], None)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    if bm <= 128:
        for (bn, warps, stages), split in itertools.product(A8X_TILES, A8X_SPLITS):
            if k % (split * 128) or (bm == 128 and (bn, warps) == (128, 4)):
                continue
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, SPLIT_K=split, num_warps=warps, num_stages=stages)
            out[f"a8x_m{bm}_n{bn}_w{warps}_s{stages}_sk{split}"] = (
                lambda x, w, q, s, cfg=cfg: fp8_gemv(xq128[0], q, s, block, kernel="a8", config=cfg,
                                                     x_scale=xq128[1], x_group=128, out_dtype=torch.bfloat16),
                "piece128")
    return out


def time_shape(name: str, n: int, k: int, block: tuple[int, int] | None, rows: tuple[int, ...], gen) -> dict:
    copies = max(2, -(-ROTATE_BYTES // (n * k)))
    weights = [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) * 0.02 for _ in range(copies)]
    quantized = [quantize_per_channel(w) if block is None else quantize_per_block(w, block) for w in weights]
    group = None if block is None else block[1]
    out = {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        q0, s0 = quantized[0]
        refs = {"bf16": (x.float() @ weights[0].float().t()),
                "token": w8a8_gemm_reference(*quantize_activation(x, group), q0, s0, block, torch.float32)}
        xq = (quantize_activation(x) if block is None
              else quantize_activation(x, group, m_major=True, pad_rows_to=CUBLAS_BLOCK_ROWS))
        row = out[m] = {}
        for label, (call, kind) in arms(m, n, k, block, xq, quantize_activation(x, 128)).items():
            try:
                if kind is not None:
                    if kind == "stream" and kind not in refs:     # weight-only: x as it is
                        refs[kind] = fp8_gemv_reference(x, q0, s0, block).float()
                    if kind.startswith("piece") and kind not in refs:
                        refs[kind] = fp8_gemv_a8_reference(x, q0, s0, block, int(kind[5:])).float()
                    err = rel_err(call(x, weights[0], q0, s0), refs[kind])
                    if err > 2e-2:
                        row[label] = {"error": f"relative error {err:.3g} against its reference"}
                        continue
                else:
                    err = None
                ms = bench(lambda i: call(x, weights[i], *quantized[i]), copies)
                weight_bytes = n * k * (2 if label == "bf16" else 1)
                row[label] = {"us": ms * 1e3, "weight_tb_s": weight_bytes / ms / 1e9, "rel_err": err}
            except Exception as e:       # a tile the compiler refuses is reported, not fatal
                row[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
        # the a8x arms time the GEMM alone: the per-piece quantization is added back here
        q128 = row.get("quantize128", {}).get("us", 0.0)
        timed = {lab: r["us"] + (q128 if lab.startswith("a8x") else 0.0) for lab, r in row.items()
                 if "us" in r and lab not in ("bf16", "quantize", "quantize128", "scaled_mm")}
        best = min(timed, key=timed.get)
        bf16_us = row.get("bf16", {}).get("us", float("nan"))
        kind = "channel" if block is None else "block"
        engine_us = row["engine"].get("us", float("nan"))
        table_us = row.get("gemv_table", {}).get("us", float("nan"))
        print(f"{name:8s} {kind:7s} m={m:4d} bf16 {bf16_us:7.1f} us | table's GEMV {table_us:7.1f} | "
              f"engine {engine_us:7.1f} "
              f"(quantize {row['quantize'].get('us', float('nan')):5.1f}, scaled_mm "
              f"{row.get('scaled_mm', {}).get('us', float('nan')):7.1f}) | best {best} {timed[best]:7.1f} us "
              f"= {bf16_us / timed[best]:.2f}x bf16", flush=True)
        a8x = {lab: r["us"] for lab, r in row.items() if lab.startswith("a8x") and "us" in r}
        if a8x:
            lab = min(a8x, key=a8x.get)
            print(f"    best GEMM alone on x quantized ahead: {lab} {a8x[lab]:.1f} us, "
                  f"{n * k / a8x[lab] / 1e6:.2f} TB/s; quantize128 {q128:.1f} us", flush=True)
        for lab, r in row.items():
            if "error" in r:
                print(f"    {lab}: {r['error'][:160]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--rows", type=parse_rows, default=ROWS, help="row counts, comma-separated (1..1024)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {','.join(SHAPES)}")
    ap.add_argument("--scales", default="channel", help="channel, block (128 x 128) or both, comma-separated")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {list(SHAPES)}")
    kinds = args.scales.split(",")
    if not kinds or any(kind not in SCALES for kind in kinds):
        ap.error(f"--scales: {args.scales!r}; known: {', '.join(SCALES)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("fp8_skinny_gemm: needs a Hopper (or later) GPU: FP8 tensor cores")
    # The a8 GEMV serves up to fp8_gemv.MAX_ROWS rows in the engine; the 32- to 128-row tiles timed here are
    # the same kernel with a taller x tile.
    fp8_gemv_module.MAX_ROWS = 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"commit": args.commit, "gpu": torch.cuda.get_device_name(), "copy_tb_s": measure_copy_bandwidth() / 1e12}
    for kind in kinds:
        res[kind] = {}
        for name in shapes:
            res[kind][name] = time_shape(name, *SHAPES[name], SCALES[kind], args.rows, gen)
            torch.cuda.empty_cache()     # the shape's weight copies are gone with its call
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
