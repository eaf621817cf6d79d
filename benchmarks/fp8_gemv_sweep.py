"""FP8 weight-only GEMV (1-16 rows) tile sweep at the Qwen3-8B linear shapes, in one short GPU run.

For each shape (qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288), rows (1, 4, 16) and
scale kind (per channel, 128x128 blocks) it checks every candidate config against the torch reference,
then times it inside a CUDA graph over weight copies larger than L2 and reports TB/s of FP8 weight bytes
against the copy bandwidth. It ends with the best config per (shape, rows, scale) as a dict literal for
kernels/fp8_gemv.py's default table.

    PYTHONPATH=$PWD python3 benchmarks/fp8_gemv_sweep.py --out $OUT/fp8_gemv_sweep.json   # H200, ~90 s
    PYTHONPATH=$PWD python3 benchmarks/fp8_gemv_sweep.py --a8x --out $OUT/fp8_a8x_sweep.json
    PYTHONPATH=$PWD python3 benchmarks/fp8_gemv_sweep.py --stream --out $OUT/stream_depth_sweep.json
    python3 benchmarks/fp8_gemv_sweep.py --smoke --out /tmp/fp8_gemv_sweep.json          # CPU interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

if "--smoke" in sys.argv[1:]:     # a smoke run is the CPU interpreter's, on a machine with a GPU too
    os.environ["TRITON_INTERPRET"] = "1"
import llmserve_core.kernels  # noqa: E402,F401  (the interpreter on CPU for --smoke)
from llmserve_core.kernels.fp8_format import quantize_per_block, quantize_per_channel  # noqa: E402
from llmserve_core.kernels.fp8_gemv import (fp8_dot_supported, fp8_gemv, fp8_gemv_a8_reference,  # noqa: E402
                                             fp8_gemv_config, fp8_gemv_reference, x_ahead_config)
from llmserve_core.kernels.fp8_quant import quantize_activation  # noqa: E402
from llmserve_core.kernels.stream_gemv import stream_gemv, stream_gemv_reference  # noqa: E402
from gemv_bench import launches_us  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SMOKE_SHAPES = {"qkv": (192, 256), "down": (128, 384)}
ROWS = (1, 4, 16)
BLOCK = (128, 128)
ROTATE_BYTES = 320 << 20     # weight bytes per timed replay: several times the H200's 60 MB L2
# (kernel, BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM the K split aims at); the tensor-core
# ("dot") tiles run all row counts, the CUDA-core ("fma") ones 1-4 rows
# (each distinct config compiles once per K split, about a second: the list is what fits ~90 s)
CANDIDATES = (("dot", 64, 256, 4, 4, 4), ("dot", 64, 256, 8, 4, 4), ("dot", 128, 256, 8, 3, 2),
              ("dot", 64, 128, 8, 3, 4),
              ("fma", 32, 256, 4, 3, 4), ("fma", 16, 512, 4, 3, 4), ("fma", 32, 512, 8, 3, 4),
              ("fma_late", 16, 512, 4, 3, 4))
FMA_MAX_ROWS = 4
# --a8: the W8A8 tiles (x quantized per 1 x BLOCK_K piece in the kernel, FP8 x FP8 on the tensor cores),
# beside the tree's defaults and, at one row, the stream kernel the engine runs today (plain and under PDL)
A8_CANDIDATES = (("a8", 64, 128, 4, 3, 4), ("a8", 64, 128, 4, 5, 4), ("a8", 64, 128, 4, 8, 4),
                 ("a8", 128, 128, 4, 4, 2), ("a8", 128, 128, 8, 4, 2), ("a8", 64, 128, 4, 4, 8))
# --a8x: one row, every tile under PDL; "a8x" reads an x quantized ahead (e4m3 + a scale per 1 x 128 piece,
# what the kernel before could write), "a8" quantizes it in the kernel, beside the same tiles. Every program
# repeats that amax pass for its tile, so a narrow tile pays it per fewer weight bytes: if the pass is what
# keeps narrow, unsplit tiles (no split-K merge) behind, "a8x" shows it.
A8X_CANDIDATES = (("a8x", 64, 128, 4, 3, 4), ("a8x", 64, 128, 4, 4, 1), ("a8x", 64, 128, 4, 6, 1),
                  ("a8x", 32, 128, 4, 3, 4), ("a8x", 32, 128, 4, 4, 2), ("a8x", 32, 128, 4, 4, 1),
                  ("a8x", 32, 128, 2, 4, 1), ("a8x", 32, 64, 4, 6, 1), ("a8x", 128, 128, 8, 4, 2),
                  ("a8", 64, 128, 4, 4, 1), ("a8", 32, 128, 4, 4, 2), ("a8", 32, 128, 4, 4, 1))
X_GROUP = 128
# --stream: one row, the CUDA-core stream kernel (kernels/stream_gemv.py) with 1 or 2 weight tiles in flight,
# or (DEPTH 0, BLOCK_K 0 here: all of K) a program's whole rows as one tile read before the wait
# (BLOCK_N, BLOCK_K, num_warps, DEPTH), under PDL, for FP8 and bf16 weights, beside what the engine runs
STREAM_CANDIDATES = ((8, 512, 4, 1), (8, 512, 4, 2), (8, 0, 8, 0), (8, 0, 16, 0), (4, 0, 4, 0), (4, 0, 8, 0),
                     (2, 0, 4, 0), (16, 0, 16, 0))


def split_for(n, k, block_n, block_k, sms, per_sm):
    """The largest power-of-two K split (<= 16) keeping n_blocks * split <= per_sm * sms that tiles K."""
    n_blocks = -(-n // block_n)
    split = 1
    while n_blocks * split * 2 <= per_sm * sms and k % (2 * split * block_k) == 0 and split < 16:
        split *= 2
    return split


def kernel_call(label, cfg, x_ahead=None):
    """x, weight, scale, block -> y for one row of the sweep: fp8_gemv in a config, or the stream kernel.
    A config marked X_AHEAD reads x_ahead (x quantized before the timed calls) in place of x."""
    if cfg is None:
        pdl = label == "stream_pdl"
        return lambda x, q, s, b: stream_gemv(x, q, s, b, pdl=pdl)
    cfg = dict(cfg)
    pdl = cfg.pop("PDL", False)
    if cfg.get("KERNEL") == "stream":
        cfg.pop("KERNEL")
        return lambda x, q, s, b: stream_gemv(x, q, s, b, pdl=pdl, config=cfg or None)
    if cfg.pop("X_AHEAD", False):
        xq, xs = x_ahead
        return lambda x, q, s, b: fp8_gemv(xq, q, s, b, config=cfg, pdl=pdl, x_scale=xs, x_group=X_GROUP,
                                           out_dtype=x.dtype)
    return lambda x, q, s, b: fp8_gemv(x, q, s, b, config=cfg, pdl=pdl)


def wall_us(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def copy_tb_s():
    from floor import measure_copy_bandwidth
    return measure_copy_bandwidth() / 1e12


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--budget-s", type=float, default=90.0, help="stop starting new timings after this many seconds")
    p.add_argument("--smoke", action="store_true", help="tiny shapes through the CPU interpreter")
    p.add_argument("--a8", action="store_true", help="the W8A8 tiles against the defaults and the stream kernel")
    p.add_argument("--a8x", action="store_true",
                   help="one row: W8A8 tiles reading an x quantized ahead against the same tiles quantizing it")
    p.add_argument("--stream", action="store_true",
                   help="one row: the stream kernel with 0 (whole rows), 1 or 2 weight tiles in flight, FP8 and bf16 weights")
    args = p.parse_args()
    t_start = time.time()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 8
    bw = copy_tb_s() if cuda else 1.0
    res = {"meta": {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "copy_tb_s": bw, "sms": sms},
           "cases": {}}
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    candidates = (CANDIDATES[3], CANDIDATES[4], CANDIDATES[-1]) if args.smoke else CANDIDATES
    if args.a8:
        candidates = A8_CANDIDATES[:1] if args.smoke else A8_CANDIDATES
    if args.a8x:
        candidates = (A8X_CANDIDATES[3], A8X_CANDIDATES[-1]) if args.smoke else A8X_CANDIDATES
    if args.stream:
        candidates = ((8, 64, 1, 1), (8, 64, 1, 2), (8, 0, 1, 0)) if args.smoke else STREAM_CANDIDATES
    rows = (1,) if args.a8x or args.stream else ROWS
    for name, (n, k) in shapes.items():
        copies = 1 if not cuda else max(2, -(-ROTATE_BYTES // (n * k)))
        w = [torch.randn(n, k, device=dev, generator=gen).to(dtype) * 0.02 for _ in range(copies)]
        weights = {"channel": [quantize_per_channel(t) + (None,) for t in w],
                   "block": [quantize_per_block(t, BLOCK) + (BLOCK,) for t in w]}
        if args.stream:
            weights["bf16"] = [(t, None, None) for t in w]
        del w
        for scale, ws in weights.items():
            for m in rows:
                x = torch.randn(m, k, device=dev, generator=gen).to(dtype)
                x_ahead = quantize_activation(x, X_GROUP)
                if scale == "bf16":
                    refs = {"weight_only": stream_gemv_reference(x, ws[0][0])}
                else:
                    refs = {"weight_only": fp8_gemv_reference(x, *ws[0]),
                            "a8": fp8_gemv_a8_reference(x, *ws[0], group=128)}
                case = {}
                # what the engine runs here (under PDL on the GPU, as the decode chain launches it)
                current = fp8_gemv_config(m, n, k, ws[0][2], sms, fp8_dot=cuda and fp8_dot_supported(x.device),
                                          stream=cuda)
                if current["KERNEL"] == "stream" or scale == "bf16":
                    configs = {"stream_pdl" if cuda else "stream": None}
                else:
                    configs = {"current": dict(current, PDL=cuda and current["KERNEL"] == "a8")}
                ahead = x_ahead_config(m, n, k, ws[0][2], sms, cuda and fp8_dot_supported(x.device))
                if args.stream and ahead is not None and scale != "bf16":
                    configs["current_x_ahead"] = dict(ahead, PDL=True, X_AHEAD=True)   # what the engine runs
                if args.stream:
                    for bn, bk, warps, depth in candidates:
                        if bk == 0 and k & (k - 1):
                            continue        # whole rows are one tile: a power-of-two K only
                        bk = bk or k
                        if k % bk == 0:
                            configs[f"stream_bn{bn}_bk{bk}_w{warps}_d{depth}"] = dict(
                                KERNEL="stream", BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1, DEPTH=depth,
                                PDL=cuda)
                    candidates_here = ()
                else:
                    candidates_here = candidates
                if args.a8 and m == 1 and cuda:     # (PDL launches need the GPU)
                    configs["stream"] = configs["stream_pdl"] = None
                for kernel, bn, bk, warps, stages, per_sm in candidates_here:
                    if kernel in ("dot", "a8", "a8x") and scale == "block" and BLOCK[1] % bk:
                        continue    # the tensor-core kernel's K tile must not straddle a scale block
                    if kernel.startswith("fma") and m > (1 if kernel == "fma_late" else FMA_MAX_ROWS):
                        continue    # (late reduction holds BLOCK_M times the registers: one row only)
                    split = split_for(n, k, bn, bk, sms, per_sm)
                    label = f"{kernel}_bn{bn}_bk{bk}_w{warps}_s{stages}_sk{split}"
                    configs[label] = dict(
                        KERNEL="a8" if kernel == "a8x" else kernel,
                        BLOCK_M=1 << (m - 1).bit_length() if kernel.startswith("fma") else 16,
                        BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages,
                        **({"X_AHEAD": True} if kernel == "a8x" else {}))
                    if args.a8x and cuda:        # as the decode chain launches them: under PDL only
                        configs[label] = dict(configs[label], PDL=True)
                    elif kernel == "a8" and cuda:
                        configs[label + "_pdl"] = dict(configs[label], PDL=True)
                for label, cfg in configs.items():
                    if time.time() - t_start > args.budget_s and label != "current":
                        case[label] = {"skipped": "time budget"}
                        continue
                    try:
                        call = kernel_call(label, cfg, x_ahead)
                        ref = refs["a8" if cfg and cfg.get("KERNEL") == "a8" else "weight_only"]
                        if scale == "bf16":
                            call = (lambda c: lambda x, q, s, b: c(x, q, None, None))(call)
                        err = rel_err(call(x, *ws[0]), ref)
                        row = {"config": cfg, "rel_err": err}
                        if err > 2e-2:
                            row["error"] = "mismatch against the reference"
                        else:   # (on the CPU: one interpreted call's wall time, which only checks the report)
                            launches = [lambda q=q, s=s, b=b: call(x, q, s, b) for q, s, b in ws]
                            us = launches_us(launches * 2) if cuda else wall_us(launches[0])
                            tb = (n * k) / us / 1e6
                            row.update(us=us, tb_s=tb, fraction_of_copy=tb / bw)
                        case[label] = row
                    except Exception as e:  # a config the scratch or the compiler refuses is reported, not fatal
                        traceback.print_exc(limit=1)
                        case[label] = {"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]}
                res["cases"][f"{name}_m{m}_{scale}"] = case
                timed = {lbl: r for lbl, r in case.items() if "us" in r}
                if timed:
                    best = min(timed, key=lambda c: timed[c]["us"])
                    cur = timed.get("current", timed.get("stream_pdl", {}))
                    print(f"{name:>8} m{m:<3}{scale:<8} current {cur.get('tb_s', float('nan')):5.2f} TB/s  "
                          f"best {best} {timed[best]['tb_s']:5.2f} TB/s ({100 * timed[best]['fraction_of_copy']:.0f}% of copy)"
                          f"  [{time.time() - t_start:.0f} s]", flush=True)
                    if args.a8x:
                        for kind in ("a8x", "a8"):
                            mine = {lbl: r for lbl, r in timed.items() if lbl.startswith(kind + "_")}
                            if mine:
                                top = min(mine, key=lambda c: mine[c]["us"])
                                print(f"{'':>8} best {kind:<4} {top} {mine[top]['tb_s']:5.2f} TB/s", flush=True)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
        del weights
        if cuda:
            torch.cuda.empty_cache()
    # the default table: best timed config per (shape, rows, scale kind)
    table = {}
    for key, case in res["cases"].items():
        timed = {lbl: r for lbl, r in case.items() if "us" in r}
        # (the stream kernel has no entry, and no layer hands the GEMV an x quantized ahead)
        timed = {lbl: r for lbl, r in timed.items() if r["config"] is not None and not r["config"].get("X_AHEAD")}
        if key.endswith("_bf16"):
            continue        # (the table is the FP8 weights')
        if timed:
            best = min(timed, key=lambda c: timed[c]["us"])
            name, rows, scale = key.split("_m")[0], int(key.split("_m")[1].split("_")[0]), key.rsplit("_", 1)[1]
            n, k = shapes[name]
            # (how it was launched is the caller's: the table holds the tile)
            table[repr((n, k, rows, scale))] = {c: v for c, v in timed[best]["config"].items() if c != "PDL"}
    res["best"] = table
    res["seconds"] = round(time.time() - t_start, 1)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"copy bandwidth {bw:.2f} TB/s, {res['seconds']} s")
    # paste into kernels/fp8_gemv.py as DEFAULT_CONFIGS (keys: N, K, rows class, scale kind)
    print("DEFAULT_CONFIGS: dict[tuple[int, int, int, str], dict] = {")
    for key, cfg in table.items():
        print(f"    {key}: {cfg!r},")
    print("}")


if __name__ == "__main__":
    main()
