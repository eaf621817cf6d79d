"""The W8A8 prefill GEMM for 128x128 block-scaled checkpoints (Qwen's FP8 releases): cuBLASLt's block-scaled
FP8 GEMM (torch._scaled_mm with 1 x 128 by 128 x 128 scales, on sm90 with CUDA >= 12.9) and the engine's
Triton tile (GPU_TILES in kernels/fp8_gemm.py) against the other tiles a block-scaled Triton tile could be:
the 128 x 128 x 128 tile over 4 warps the engine used until 04f759d (it spills 296 bytes a thread), 8 warps,
64 rows, and wider ones, at the Qwen3-8B projections and 17 to 8,192 rows, in CUDA graphs. If one beats the
Triton tile by 3% (geometric mean over every shape and row count), the engine's whole prefill step of a
block-scaled Qwen3-8B (dummy weights quantized as the checkpoint would be) runs on the Triton tile and on the
winner, alternating, twice each: the step is the verdict, not the kernel alone.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/fp8_block_gemm_tiles.py --out $OUT/fp8_block_gemm.json  # ~2 min
    python3 benchmarks/fp8_block_gemm_tiles.py --smoke --out /tmp/fp8_block_gemm.json   # tiny, CPU interpreter

A smoke run takes its first candidate as the winner whatever it measured, so the engine verdict (on the tiny
model's shape, CPU) runs too.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv[1:]:     # a smoke run is the CPU interpreter's, on a machine with a GPU too
    os.environ["TRITON_INTERPRET"] = "1"
import llmserve_core.kernels.fp8_gemm as fp8_gemm_module  # noqa: E402
from llmserve_core.kernels.fp8_format import quantize_per_block  # noqa: E402
from llmserve_core.kernels.fp8_gemm import (scaled_mm_supported, w8a8_block_linear,  # noqa: E402
                                             w8a8_gemm_reference, w8a8_gemm_triton)
from llmserve_core.kernels.fp8_quant import quantize_activation  # noqa: E402
from fp8_tma_tiles import time_configs  # noqa: E402
from qwen3_8b import QWEN_FP8_BLOCK_CONFIG, write_qwen3_8b_dir  # noqa: E402

BLOCK = (128, 128)
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (17, 32, 256, 2048, 8192)     # 17: the fewest rows past the GEMV, padded for cuBLAS
# (BLOCK_M, BLOCK_N, warps, stages)
CANDIDATES = {"m{}_n{}_w{}_s{}".format(*t): t for t in ((128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4),
                                                        (64, 128, 4, 4), (128, 256, 8, 3), (64, 256, 4, 3))}
PREFILLS = "1x512,4x2048"     # (prompts)x(tokens each) of the timed prefill steps
CUBLAS = "cublas"
# What main() runs: the GPU at the 8B shapes, or (--smoke) the CPU interpreter on a tiny one; "engine" is
# what the prefill verdict's EngineConfig adds, "vocab" the token ids its prompts draw from.
RUN = {"dev": "cuda", "dt": torch.bfloat16, "shapes": SHAPES, "rows": ROWS, "candidates": CANDIDATES,
       "engine": dict(load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.85), "vocab": 150000}
SMOKE = dict(dev="cpu", dt=torch.float32, shapes={"qkv": (256, 256)}, rows=(17,),
             candidates={"m128_n128_w4_s3": CANDIDATES["m128_n128_w4_s3"]},
             engine=dict(load_format="dummy", max_model_len=512, device="cpu", num_kv_blocks=256), vocab=1024)


def sync() -> None:
    if RUN["dev"] == "cuda":
        torch.cuda.synchronize()


def engine_tile(rows: int) -> tuple:
    return fp8_gemm_module.GPU_TILES[(rows > 64, True)]


def time_kernels(gen) -> dict:
    """shape -> rows -> label -> {config, us, tflops, rel_err} (or the error), each timing x's quantization
    and the GEMM, as a layer runs them. "engine" is the Triton tile the engine runs at that row count where
    cuBLAS does not take the layout; "cublas" is w8a8_block_linear's torch._scaled_mm."""
    out = {}
    dev, dt = RUN["dev"], RUN["dt"]
    for name, (n, k) in RUN["shapes"].items():
        weight = quantize_per_block(torch.randn(n, k, device=dev, generator=gen).to(dt) * 0.02, BLOCK)
        cublas = scaled_mm_supported(torch.device(dev), n, k, torch.bfloat16, BLOCK)
        out[name] = {}
        for m in RUN["rows"]:
            tiles = {"engine": engine_tile(m),
                     **{lab: t for lab, t in RUN["candidates"].items() if t != engine_tile(m)}}
            if cublas:
                tiles[CUBLAS] = CUBLAS
            x = torch.randn(m, k, device=dev, generator=gen).to(dt)
            ref = w8a8_gemm_reference(*quantize_activation(x, BLOCK[1]), *weight, BLOCK, torch.float32)

            def call_and_reference(tile, ref=ref):
                # each arm as the engine runs it: x quantized per 1 x 128 piece, then the GEMM
                if tile == CUBLAS:
                    return lambda x, q, s: w8a8_block_linear(x, q, s, BLOCK, torch.bfloat16), ref
                bm, bn, warps, stages = tile
                return (lambda x, q, s: w8a8_gemm_triton(*quantize_activation(x, BLOCK[1]), q, s, BLOCK,
                                                         dt, block_m=bm, block_n=bn,
                                                         num_warps=warps, num_stages=stages), ref)
            row = out[name][m] = time_configs(tiles, call_and_reference, x, [weight], tolerance=1e-2)
            for r in row.values():
                if "us" in r:
                    r["tflops"] = 2 * m * n * k / r["us"] / 1e6
            for lab, r in row.items():
                if "error" in r:
                    print(f"    {name} m={m} {lab}: {r['error'][:200]}", flush=True)
            best = max((lab for lab in row if "us" in row[lab]), key=lambda lab: row[lab]["tflops"])
            print(f"{name:8s} m={m:5d} engine tile {row['engine'].get('tflops', 0):6.0f} TFLOP/s, cublas "
                  f"{row.get(CUBLAS, {}).get('tflops', 0):6.0f}, best {best} {row[best]['tflops']:6.0f}", flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


def host_us_per_call(rows: int = 512, calls: int = 200) -> dict:
    """Host microseconds a layer's block-scaled GEMM call takes (quantization included) on each path, qkv's
    shape, the GPU left to run behind: what an eager step that the host bounds pays per call."""
    n, k = RUN["shapes"]["qkv"]
    dev, dt = RUN["dev"], RUN["dt"]
    w, ws = quantize_per_block(torch.randn(n, k, device=dev).to(dt) * 0.02, BLOCK)
    x = torch.randn(rows, k, device=dev).to(dt)
    paths = {"triton": lambda: w8a8_gemm_triton(*quantize_activation(x, BLOCK[1]), w, ws, BLOCK, dt)}
    if scaled_mm_supported(x.device, n, k, torch.bfloat16, BLOCK):
        paths[CUBLAS] = lambda: w8a8_block_linear(x, w, ws, BLOCK, torch.bfloat16)
    out = {}
    for name, call in paths.items():
        for _ in range(min(20, calls)):
            call()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        sync()
    print("host us per call at 512 rows: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


def geomean_ratio(kernels: dict) -> dict:
    """label -> geometric mean of (engine us / its us) over every shape and row count it ran."""
    ratios = {}
    for rows in kernels.values():
        for row in rows.values():
            for lab, r in row.items():
                if "us" in r and "us" in row["engine"]:
                    ratios.setdefault(lab, []).append(row["engine"]["us"] / r["us"])
    count = sum(len(rows) for rows in kernels.values())
    return {lab: math.exp(statistics.fmean(map(math.log, v))) for lab, v in ratios.items() if len(v) == count}


def write_block_scaled_dir() -> str:
    if RUN["dev"] == "cpu":        # the tiny shape, whose widths take 16-wide scale blocks (the CPU's only)
        import decode_profile
        return decode_profile.use_smoke_model(tempfile.mkdtemp(), quantization_config=dict(
            QWEN_FP8_BLOCK_CONFIG, weight_block_size=[16, 16]))
    return write_qwen3_8b_dir(tempfile.mkdtemp(), quantization_config=QWEN_FP8_BLOCK_CONFIG)


def prefill_ms(engine, prompts: int, tokens: int, rnd: random.Random, reps: int, ids) -> float:
    """Median ms of an Engine.step() that prefills `prompts` fresh prompts of `tokens` tokens, to the end of
    its GPU work (with async scheduling step() returns once the forward is launched)."""
    from llmserve_proto import SamplingParams
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times = []
    for rep in range(reps + 2):               # two untimed: the first of each shape warms the allocator
        for i in range(prompts):
            engine.add_request(f"p{next(ids)}", [rnd.randrange(3, RUN["vocab"]) for _ in range(tokens)], params)
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        if rep >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times)


def parse_prefills(text: str) -> list[tuple[int, int]]:
    """"1x512,4x2048" -> [(1, 512), (4, 2048)]: prompts and tokens each of a prefill step (8,192 tokens at most)."""
    steps = []
    for item in text.split(","):
        prompts, _, tokens = item.partition("x")
        if not (prompts.isdigit() and tokens.isdigit()) or not 1 <= int(prompts) * int(tokens) <= 8192 \
                or not 1 <= int(tokens) <= 4000 or int(prompts) > 8:
            raise argparse.ArgumentTypeError(f"--prefills: {item!r} is not PROMPTSxTOKENS (up to 8 prompts of "
                                             f"up to 4,000 tokens, 8,192 in all)")
        steps.append((int(prompts), int(tokens)))
    return steps


def engine_verdict(winner: str, reps: int, prefills: list[tuple[int, int]]) -> dict:
    """The prefill steps on the engine's Triton tile ("triton": cuBLAS refused the layout) and on `winner`
    (a candidate tile, with cuBLAS refused too, or "cublas"), alternating, twice each."""
    from llmserve_core import Engine, EngineConfig
    engine = Engine(EngineConfig(model=write_block_scaled_dir(), max_num_seqs=8, max_num_batched_tokens=8192,
                                 warmup=False, **RUN["engine"]))  # each variant's untimed steps compile what it needs
    rnd, ids, out = random.Random(0), itertools.count(), {}
    tiles, supported = dict(fp8_gemm_module.GPU_TILES), fp8_gemm_module.scaled_mm_supported

    def refuse_blocks(device, n, k, out_dtype, block=None):
        return block is None and supported(device, n, k, out_dtype)
    try:
        for variant in ("triton", winner, "triton2", winner + "2"):
            fp8_gemm_module.GPU_TILES.update(tiles)
            fp8_gemm_module.scaled_mm_supported = supported if variant.startswith(CUBLAS) else refuse_blocks
            if variant.startswith(winner) and winner != CUBLAS:
                for key in ((False, True), (True, True)):
                    fp8_gemm_module.GPU_TILES[key] = CANDIDATES[winner]
            for prompts, tokens in prefills:
                ms = prefill_ms(engine, prompts, tokens, rnd, reps, ids)
                out.setdefault(f"{prompts}x{tokens}", {})[variant] = ms
                print(f"prefill {prompts}x{tokens:5d} {variant:9s} {ms:8.2f} ms", flush=True)
    finally:
        fp8_gemm_module.GPU_TILES.update(tiles)
        fp8_gemm_module.scaled_mm_supported = supported
    for case in out.values():
        case["speedup"] = (case["triton"] + case["triton2"]) / (case[winner] + case[winner + "2"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--prefills", type=parse_prefills, default=parse_prefills(PREFILLS),
                    help=f"the timed prefill steps, PROMPTSxTOKENS,... (default {PREFILLS})")
    ap.add_argument("--step-only", choices=[CUBLAS, *CANDIDATES], default=None,
                    help="skip the kernel table: time the prefill steps on the Triton tile and this arm")
    ap.add_argument("--reps", type=int, default=5, choices=range(1, 101), metavar="1..100",
                    help="timed prefill steps per variant and shape")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape on the CPU interpreter, then the verdict on the tiny model (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        RUN.update(SMOKE)
    elif not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        sys.exit("fp8_block_gemm_tiles: needs an FP8 GPU (sm89 or later)")
    out = {"commit": args.commit, "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "engine_tiles": {str(k): v for k, v in fp8_gemm_module.GPU_TILES.items()}}
    out["host_us_per_call"] = {} if args.smoke else host_us_per_call()   # the interpreter's host time means nothing
    if args.step_only:
        out["candidate"] = args.step_only
        out["engine"] = engine_verdict(args.step_only, args.reps, args.prefills)
    else:
        out["kernels"] = time_kernels(torch.Generator(device=RUN["dev"]).manual_seed(0))
        out["geomean_speedup"] = geomean_ratio(out["kernels"])
        best = max(out["geomean_speedup"], key=out["geomean_speedup"].get)
        if args.smoke:      # the interpreter's times mean nothing: take a candidate, to run the verdict too
            best, out["geomean_speedup"][best] = next(iter(RUN["candidates"])), 2.0
        print("geomean speedup over the engine's Triton tile: " + ", ".join(
            f"{lab} {r:.3f}" for lab, r in sorted(out["geomean_speedup"].items(), key=lambda x: -x[1])))
        if best != "engine" and out["geomean_speedup"][best] > 1.03:
            out["candidate"] = best
            out["engine"] = engine_verdict(best, args.reps, args.prefills)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
