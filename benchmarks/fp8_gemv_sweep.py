"""FP8 weight-only GEMV (1-16 rows) tile sweep at the Qwen3-8B linear shapes, in one short GPU run.

For each shape (qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288), rows (1, 4, 16) and
scale kind (per channel, 128x128 blocks) it checks every candidate config against the torch reference,
then times it inside a CUDA graph over weight copies larger than L2 and reports TB/s of FP8 weight bytes
against the copy bandwidth. The winners go into this card's tables (write_winners): kernels/configs/
fp8_gemv/ (which kernel and tile the raw rows of a (shape, rows, scale) take, or with --a8x whether one row
quantized ahead beats them) and with --stream kernels/configs/stream_gemv/ (the one-row stream tiles).

    PYTHONPATH=$PWD python3 benchmarks/fp8_gemv_sweep.py --out $OUT/fp8_gemv_sweep.json   # H200, ~90 s
    PYTHONPATH=$PWD python3 benchmarks/fp8_gemv_sweep.py --a8x --out $OUT/fp8_a8x_sweep.json
    PYTHONPATH=$PWD python3 benchmarks/fp8_gemv_sweep.py --stream --out $OUT/stream_depth_sweep.json \
        --configs $OUT/configs        # the tables to copy back into llmserve_core/kernels/configs/
    python3 benchmarks/fp8_gemv_sweep.py --smoke --out /tmp/fp8_gemv_sweep.json          # CPU interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

if "--smoke" in sys.argv[1:]:     # a smoke run is the CPU interpreter's, on a machine with a GPU too
    os.environ["TRITON_INTERPRET"] = "1"
import llmserve_core.kernels  # noqa: E402,F401  (the interpreter on CPU for --smoke)
from llmserve_core.kernels.fp8_format import quantize_per_block, quantize_per_channel  # noqa: E402
from llmserve_core.kernels import tuned  # noqa: E402
from llmserve_core.kernels.fp8_gemv import choose, fp8_gemv, fp8_gemv_a8_reference, fp8_gemv_reference  # noqa: E402
from llmserve_core.kernels.fp8_quant import quantize_activation  # noqa: E402
from llmserve_core.kernels.stream_gemv import stream_gemv, stream_gemv_reference, stream_tiles  # noqa: E402
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


def kernel_call(cand, x_ahead=None):
    """x, weight, scale, block -> y for one candidate of the sweep: {"kernel", "tile", "pdl", "x_ahead"}, the
    kernel "stream" (kernels/stream_gemv.py) or one of kernels/fp8_gemv.py's; x_ahead: read x_ahead (x
    quantized before the timed calls) in place of x."""
    kernel, tile, pdl = cand["kernel"], cand.get("tile"), cand.get("pdl", False)
    if kernel == "stream":
        return lambda x, q, s, b: stream_gemv(x, q, s, b, pdl=pdl, config=tile)
    if cand.get("x_ahead"):
        xq, xs = x_ahead
        return lambda x, q, s, b: fp8_gemv(xq, q, s, b, kernel=kernel, config=tile, pdl=pdl, x_scale=xs,
                                           x_group=X_GROUP, out_dtype=x.dtype)
    return lambda x, q, s, b: fp8_gemv(x, q, s, b, kernel=kernel, config=tile, pdl=pdl)


def engine_candidates(device, m, n, k, block, scale, cuda, stream_mode) -> dict:
    """What the engine runs here (under PDL on the GPU, as the decode chain launches it): the stream kernel
    at its tile, or kernels/fp8_gemv.choose's kernel and tile; with stream_mode also its tile for x
    quantized ahead."""
    if scale == "bf16":
        tile = dict(stream_tiles(device, n, k, torch.bfloat16))
        return {"stream_pdl" if cuda else "stream": {"kernel": "stream", "tile": tile, "pdl": cuda}}
    current = choose(device, m, n, k, block, stream=cuda)
    if current.kernel == "stream":
        configs = {"stream_pdl" if cuda else "stream": {"kernel": "stream", "tile": dict(current.tile), "pdl": cuda}}
    else:
        configs = {"current": {"kernel": current.kernel, "tile": dict(current.tile),
                               "pdl": cuda and current.kernel == "a8"}}
    ahead = choose(device, m, n, k, block, x="fp8")
    if stream_mode and ahead is not None:
        configs["current_x_ahead"] = {"kernel": ahead.kernel, "tile": dict(ahead.tile), "pdl": True, "x_ahead": True}
    return configs


def sweep_candidates(args, candidates, m, n, k, scale, sms, cuda) -> dict:
    """The candidates timed beside the engine's: stream tiles (--stream), or fp8_gemv tiles."""
    configs = {}
    if args.stream:
        for bn, bk, warps, depth in candidates:
            if bk == 0 and k & (k - 1):
                continue        # whole rows are one tile: a power-of-two K only
            bk = bk or k
            if k % bk == 0:
                configs[f"stream_bn{bn}_bk{bk}_w{warps}_d{depth}"] = {"kernel": "stream", "pdl": cuda, "tile": dict(
                    BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1, DEPTH=depth)}
        return configs
    if args.a8 and m == 1 and cuda:     # the stream kernel, plain and under PDL (PDL launches need the GPU)
        configs["stream"] = {"kernel": "stream"}
        configs["stream_pdl"] = {"kernel": "stream", "pdl": True}
    for kernel, bn, bk, warps, stages, per_sm in candidates:
        if kernel in ("dot", "a8", "a8x") and scale == "block" and BLOCK[1] % bk:
            continue    # the tensor-core kernel's K tile must not straddle a scale block
        if kernel.startswith("fma") and m > (1 if kernel == "fma_late" else FMA_MAX_ROWS):
            continue    # (late reduction holds BLOCK_M times the registers: one row only)
        split = split_for(n, k, bn, bk, sms, per_sm)
        label = f"{kernel}_bn{bn}_bk{bk}_w{warps}_s{stages}_sk{split}"
        cand = {"kernel": "a8" if kernel == "a8x" else kernel, "x_ahead": kernel == "a8x", "tile": dict(
            BLOCK_M=1 << (m - 1).bit_length() if kernel.startswith("fma") else 16,
            BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)}
        if args.a8x and cuda:        # as the decode chain launches them: under PDL only
            cand["pdl"] = True
        configs[label] = cand
        if kernel == "a8" and cuda and not args.a8x:
            configs[label + "_pdl"] = dict(cand, pdl=True)
    return configs


def patched_tables(kernel: str, entries: list, source: str, device_name: str) -> Path:
    """A copy of the tree's tables with entries merged into `kernel`'s table for device_name: point
    tuned.CONFIG_DIR at it (and clear_cache) to run the engine as patched in the same process."""
    import shutil
    import tempfile
    tables = Path(tempfile.mkdtemp()) / "configs"
    shutil.copytree(tuned.CONFIG_DIR, tables)
    tuned.write_configs(kernel, device_name, entries, source, tables)
    return tables


def wall_us(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def copy_tb_s():
    from floor import measure_copy_bandwidth
    return measure_copy_bandwidth() / 1e12


def time_case(configs, x, x_ahead, ws, refs, scale, n, k, bw, cuda, deadline) -> dict:
    """Each candidate checked against its arithmetic's reference, then timed: label -> row."""
    case = {}
    for label, cand in configs.items():
        if time.time() > deadline and label != "current":
            case[label] = {"skipped": "time budget"}
            continue
        try:
            call = kernel_call(cand, x_ahead)
            ref = refs["a8" if cand["kernel"] == "a8" else "weight_only"]
            if scale == "bf16":
                call = (lambda c: lambda x, q, s, b: c(x, q, None, None))(call)
            err = rel_err(call(x, *ws[0]), ref)
            row = {"config": cand, "rel_err": err}
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
            case[label] = {"config": cand, "error": f"{type(e).__name__}: {e}"[:300]}
    return case


def report(name, m, scale, case, a8x, t_start) -> None:
    timed = {lbl: r for lbl, r in case.items() if "us" in r}
    if not timed:
        return
    best = min(timed, key=lambda c: timed[c]["us"])
    cur = timed.get("current", timed.get("stream_pdl", {}))
    print(f"{name:>8} m{m:<3}{scale:<8} current {cur.get('tb_s', float('nan')):5.2f} TB/s  "
          f"best {best} {timed[best]['tb_s']:5.2f} TB/s ({100 * timed[best]['fraction_of_copy']:.0f}% of copy)"
          f"  [{time.time() - t_start:.0f} s]", flush=True)
    if a8x:
        for kind in ("a8x", "a8"):
            mine = {lbl: r for lbl, r in timed.items() if lbl.startswith(kind + "_")}
            if mine:
                top = min(mine, key=lambda c: mine[c]["us"])
                print(f"{'':>8} best {kind:<4} {top} {mine[top]['tb_s']:5.2f} TB/s", flush=True)


def winners(res: dict, shapes: dict, mode: str) -> dict[str, list]:
    """Each case's fastest checked config as table entries, per kernel family: --stream the stream tile of
    each (shape, weight kind); --a8x whether one row quantized ahead beats every raw config (its tile, or the
    entry removed); otherwise the kernel and tile raw rows of each (shape, rows, scale) take."""
    out = {"fp8_gemv": [], "stream_gemv": []}
    for key, case in res["cases"].items():
        name, rest = key.split("_m", 1)
        m, scale = int(rest.split("_")[0]), rest.split("_", 1)[1]
        n, k = shapes[name]
        timed = {lbl: r for lbl, r in case.items() if "us" in r}
        raw = {lbl: r for lbl, r in timed.items() if not r["config"].get("x_ahead")}
        ahead = {lbl: r for lbl, r in timed.items() if r["config"].get("x_ahead")}
        best = (lambda rows: rows[min(rows, key=lambda lbl: rows[lbl]["us"])] if rows else None)
        scale_key = "none" if scale == "bf16" else tuned.scale_key(BLOCK if scale == "block" else None)
        shape = {"N": n, "K": k, "rows": m, "scale": scale_key}
        if mode == "stream":
            top = best({lbl: r for lbl, r in raw.items() if r["config"]["kernel"] == "stream"})
            if top is not None:
                dtype = "bf16" if scale == "bf16" else "fp8"
                out["stream_gemv"].append(({"N": n, "K": k, "dtype": dtype, "scale": scale_key}, top["config"]["tile"]))
        elif mode == "a8x":
            top, beaten = best(ahead), best(raw)
            wins = top is not None and (beaten is None or top["us"] < beaten["us"])
            entry = {"kernel": top["config"]["kernel"], "tile": top["config"]["tile"]} if wins else None
            out["fp8_gemv"].append((dict(shape, x="fp8"), entry))
        elif (top := best(raw)) is not None:
            cfg = top["config"]
            out["fp8_gemv"].append((dict(shape, x="raw"), {"kernel": "stream"} if cfg["kernel"] == "stream"
                                    else {"kernel": cfg["kernel"], "tile": cfg["tile"]}))
    return out


def write_winners(res: dict, shapes: dict, args, device_name: str) -> list[str]:
    """The winners merged into this card's tables under args.configs; the paths written."""
    mode = "stream" if args.stream else "a8x" if args.a8x else "a8" if args.a8 else "tiles"
    source = f"benchmarks/fp8_gemv_sweep.py{'' if mode == 'tiles' else ' --' + mode} ({os.path.basename(args.out)})"
    return [str(tuned.write_configs(kernel, device_name, entries, source, Path(args.configs)))
            for kernel, entries in winners(res, shapes, mode).items() if entries]


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
    p.add_argument("--configs", default=None,
                   help="merge the winners into this card's tables under this folder (default on a GPU: the tree's "
                        "llmserve_core/kernels/configs; a --smoke run writes none unless given one)")
    args = p.parse_args()
    t_start = time.time()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    device = tuned.device_spec(torch.device(dev))
    dtype = torch.bfloat16 if cuda else torch.float32
    bw = copy_tb_s() if cuda else 1.0
    res = {"meta": {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "copy_tb_s": bw, "sms": device.sms},
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
                configs = engine_candidates(device, m, n, k, ws[0][2], scale, cuda, args.stream)
                configs.update(sweep_candidates(args, candidates, m, n, k, scale, device.sms, cuda))
                case = time_case(configs, x, x_ahead, ws, refs, scale, n, k, bw, cuda, t_start + args.budget_s)
                res["cases"][f"{name}_m{m}_{scale}"] = case
                report(name, m, scale, case, args.a8x, t_start)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
        del weights
        if cuda:
            torch.cuda.empty_cache()
    res["seconds"] = round(time.time() - t_start, 1)
    if args.configs is None and cuda:
        args.configs = str(tuned.CONFIG_DIR)
    if args.configs is not None:
        res["tables"] = write_winners(res, shapes, args, torch.cuda.get_device_name() if cuda else "cpu")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"copy bandwidth {bw:.2f} TB/s, {res['seconds']} s; tables written: {res.get('tables', [])}")


if __name__ == "__main__":
    main()
