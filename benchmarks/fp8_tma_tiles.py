"""One-row FP8 "a8" GEMVs whose weight tiles come by TMA (a tensor descriptor: one copy-engine request a
tile into shared memory, no per-thread addresses or registers on the way), against the table's kernels,
timed under PDL as the decode chain runs them (per-channel scales, CUDA graphs over weight copies larger
than L2). gate_up's and qkv's candidates read x quantized ahead, as the engine hands their 2-16 rows (the
engine streams one row of every projection through the stream kernel, their "current", gate_up's ending in
the SiLU-and-mul there; a winner would be patched in as the x-ahead tile); down's candidates quantize x in
the kernel. Every candidate compiles for sm_90 (benchmarks/sm90_compile.py's compiler, checked without a
GPU). A TMA tile that beats the engine's kernel for its shape by 3% is patched into a copy of this card's
kernels/configs/fp8_gemv/ table (its one-row entry), and the FP8 batch-1 decode step then runs with the
tables as committed and as patched, alternating, twice each, in the same process: the step is the verdict,
not the kernel alone. Needs a Hopper GPU.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/fp8_tma_tiles.py --out $OUT/fp8_tma.json   # H200, ~2 min
    python3 benchmarks/fp8_tma_tiles.py --smoke --out /tmp/fp8_tma.json    # tiny shapes, CPU interpreter

A smoke run patches the best candidate in whatever it measured, so the table-patching path runs too.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv[1:]:     # a smoke run is the CPU interpreter's, on a machine with a GPU too
    os.environ["TRITON_INTERPRET"] = "1"
from llmserve_core.kernels import tuned  # noqa: E402
from llmserve_core.kernels.fp8_format import quantize_per_channel  # noqa: E402
from llmserve_core.kernels.fp8_gemv import X_AHEAD_GROUP, choose, fp8_gemv, fp8_gemv_a8_reference  # noqa: E402
from llmserve_core.kernels.fp8_quant import quantize_activation  # noqa: E402
from llmserve_core.kernels.stream_gemv import stream_gemv, stream_gemv_reference  # noqa: E402
from floor import measure_bf16_peak, measure_copy_bandwidth  # noqa: E402
from fp8_gemv_sweep import ROTATE_BYTES, SHAPES, patched_tables, split_for  # noqa: E402
from gemv_bench import launches_us  # noqa: E402
from qwen3_8b import write_qwen3_8b_dir  # noqa: E402

X_AHEAD = ("qkv", "gate_up")       # the shapes whose candidates read x quantized by the RMSNorm before
# (BLOCK_N, BLOCK_K, warps, stages, programs per SM the K split aims at)
CANDIDATES = ((64, 128, 4, 3, 4), (64, 128, 4, 4, 4), (64, 128, 4, 6, 4), (64, 128, 4, 6, 2), (128, 128, 4, 4, 2),
              (128, 128, 8, 4, 2), (128, 128, 4, 6, 2), (64, 256, 4, 4, 4), (128, 256, 4, 3, 2), (32, 128, 4, 8, 2))
# What main() runs: the GPU at the 8B shapes under PDL, or (--smoke) the CPU interpreter on tiny ones.
RUN = {"dev": "cuda", "dt": torch.bfloat16, "shapes": SHAPES, "pdl": True, "candidates": CANDIDATES, "copies": None}
SMOKE = dict(dev="cpu", dt=torch.float32, shapes={"qkv": (192, 256), "down": (128, 384)}, pdl=False,
             candidates=(CANDIDATES[0], CANDIDATES[4]), copies=1)


def time_configs(configs: dict, call_and_reference, x, weights, tolerance: float = 2e-2) -> dict:
    """label -> {config, us, tb_s, rel_err} (or the error) for each config: call_and_reference(cfg) gives
    the (x, weight, scale) -> y call and what it must compute on weights[0] (within `tolerance`, relative);
    timed over every weight copy, twice, in one CUDA graph."""
    n, k = weights[0][0].shape
    case = {}
    for label, cfg in configs.items():
        try:
            call, ref = call_and_reference(cfg)
            ref = ref.float()
            err = ((call(x, *weights[0]).float() - ref).norm() / ref.norm()).item()
            if err > tolerance:
                case[label] = {"config": cfg, "error": f"relative error {err:.3g} against the reference"}
                continue
            us = launches_us([lambda q=q, s=s: call(x, q, s) for q, s in weights] * 2)
            case[label] = {"config": cfg, "us": us, "tb_s": n * k / us / 1e6, "rel_err": err}
        except Exception as e:       # a tile the compiler refuses is reported, not fatal
            case[label] = {"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]}
    return case


def call_for(name: str, cfg: dict | None, x_ahead):
    """(x, weight, scale) -> y at this a8 tile, under PDL (None: the stream kernel)."""
    pdl = RUN["pdl"]
    if cfg is None:
        return lambda x, q, s: stream_gemv(x, q, s, None, pdl=pdl)
    if name in X_AHEAD:
        xq, xs = x_ahead
        return lambda x, q, s: fp8_gemv(xq, q, s, None, kernel="a8", config=cfg, pdl=pdl, x_scale=xs,
                                        x_group=X_AHEAD_GROUP, out_dtype=x.dtype)
    return lambda x, q, s: fp8_gemv(x, q, s, None, kernel="a8", config=cfg, pdl=pdl)


def card() -> tuned.Device:
    """The card the tables are read for; a smoke run's CPU answers as one with FP8 products (the a8 kernel)."""
    device = tuned.device_spec(torch.device(RUN["dev"]))
    return device if RUN["dev"] == "cuda" else dataclasses.replace(device, capability=(9, 0))


def engine_config(name: str, n: int, k: int) -> dict | None:
    """The a8 tile the engine runs at one row for this shape (None: the stream kernel)."""
    choice = (choose(card(), 1, n, k, x="fp8") if name in X_AHEAD else None) or choose(card(), 1, n, k, stream=True)
    assert choice.kernel in ("stream", "a8"), f"fp8_tma_tiles: the engine runs {choice.kernel} for {name}"
    return None if choice.kernel == "stream" else dict(choice.tile)


def time_shape(name: str, n: int, k: int, gen) -> dict:
    copies = RUN["copies"] or max(2, -(-ROTATE_BYTES // (n * k)))
    dev, dt = RUN["dev"], RUN["dt"]
    weights = [quantize_per_channel(torch.randn(n, k, device=dev, generator=gen).to(dt) * 0.02)
               for _ in range(copies)]
    x = torch.randn(1, k, device=dev, generator=gen).to(dt)
    x_ahead = quantize_activation(x, X_AHEAD_GROUP)
    current = engine_config(name, n, k)
    configs = {"current": current}
    if current is not None:
        configs["current_tma"] = dict(current, TMA=True)
    for bn, bk, warps, stages, per_sm in RUN["candidates"]:
        if name in X_AHEAD and X_AHEAD_GROUP % bk:
            continue        # a K tile may not straddle two of x's scales
        split = split_for(n, k, bn, bk, card().sms, per_sm)
        configs[f"tma_bn{bn}_bk{bk}_w{warps}_s{stages}_sk{split}"] = dict(
            BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages, TMA=True)
    # Each kernel against its own arithmetic: the stream kernel reads x in bf16; the a8 tiles quantize x per
    # 1 x 128 piece ahead, or in the kernel per 1 x BLOCK_K piece (the two differ by x's quantization error,
    # about 2%, more than the check allows).

    @functools.cache
    def reference(group: int | None):       # None: the stream kernel's; one float32 pass per distinct arithmetic
        if group is None:
            return stream_gemv_reference(x, *weights[0])
        return fp8_gemv_a8_reference(x, *weights[0], None, group=group)

    def group_of(cfg):
        return None if cfg is None else X_AHEAD_GROUP if name in X_AHEAD else cfg["BLOCK_K"]
    return time_configs(configs, lambda cfg: (call_for(name, cfg, x_ahead), reference(group_of(cfg))), x, weights)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        RUN.update(SMOKE)
    elif not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("fp8_tma_tiles: needs a Hopper (or later) GPU: TMA, and the chain's kernels launch under PDL")
    copy_rate = (lambda: 1e11) if args.smoke else measure_copy_bandwidth
    out = {"commit": args.commit, "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
           "copy_tb_s": copy_rate() / 1e12, "cases": {}, "engine": {}}
    gen = torch.Generator(device=RUN["dev"]).manual_seed(0)
    patch = {}
    for name, (n, k) in RUN["shapes"].items():
        case = out["cases"][name] = time_shape(name, n, k, gen)
        for label, r in case.items():
            if "error" in r:
                print(f"    {label}: {r['error'][:160]}", flush=True)
        timed = {label: r for label, r in case.items() if "us" in r}
        if "current" not in timed:
            sys.exit(f"fp8_tma_tiles: the engine's own kernel for {name} failed its check")
        best = min(timed, key=lambda label: timed[label]["us"])
        print(f"{name:8s} engine {timed['current']['us']:6.2f} us {timed['current']['tb_s']:.2f} TB/s; "
              f"same tile by TMA {timed.get('current_tma', {}).get('tb_s', float('nan')):.2f}; "
              f"best {best} {timed[best]['us']:.2f} us {timed[best]['tb_s']:.2f} TB/s", flush=True)
        if args.smoke:      # the interpreter's times mean nothing: patch any candidate, to run that path
            best = next((label for label in timed if label != "current"), "current")
        if best != "current" and (args.smoke or timed[best]["us"] < 0.97 * timed["current"]["us"]):
            patch[name] = timed[best]["config"]
        if not args.smoke:
            torch.cuda.empty_cache()
    out["patch"] = patch
    if not patch:
        print("no TMA tile beat the engine's kernel by 3%: no engine run", flush=True)
    else:
        import decode_profile
        if args.smoke:
            peak, model_dir = 1e12, decode_profile.use_smoke_model(tempfile.mkdtemp())
        else:
            peak, model_dir = measure_bf16_peak(), write_qwen3_8b_dir(tempfile.mkdtemp())
        committed = tuned.CONFIG_DIR
        patched = patched_tables("fp8_gemv", [
            ({"N": RUN["shapes"][name][0], "K": RUN["shapes"][name][1], "rows": 1, "scale": scale,
              "x": "fp8" if name in X_AHEAD else "raw"}, {"kernel": "a8", "tile": cfg})
            for name, cfg in patch.items() for scale in ("channel", "128x128")], "benchmarks/fp8_tma_tiles.py",
            card().name)
        for variant in ("table", "patched") if args.smoke else ("table", "patched", "table2", "patched2"):
            tuned.CONFIG_DIR = patched if variant.startswith("patched") else committed
            tuned.clear_cache()
            r = decode_profile.run_batch(model_dir, 1, 16 if args.smoke else 512, copy_rate(), peak,
                                         2 if args.smoke else args.steps, False, "fp8", "auto")
            out["engine"][variant] = {key: r[key] for key in ("step_ms", "floor_ms", "fraction_of_floor",
                                                              "kernels_per_step")}
            print(f"fp8 batch 1, {variant:9s} step {r['step_ms']:.3f} ms ({100 * r['fraction_of_floor']:.1f}% of "
                  f"the floor)", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
