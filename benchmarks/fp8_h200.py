"""FP8 against bf16 at the Qwen3-8B shape (dummy weights), in one run on one GPU.

  1. copy bandwidth: the roofline the decode numbers are held against;
  2. kernels at the 8B linear shapes (qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288):
     - 1 and 16 rows: bf16 F.linear vs the FP8 weight-only GEMV (per-channel and 128x128 block scales), in
       weight GB/s (the GEMV's tile sweep, behind its defaults, is benchmarks/fp8_gemv_sweep.py);
     - 64-8192 rows: bf16 matmul vs W8A8 per channel (torch._scaled_mm and Triton, activation quantization
       included), W8A8 128x128 block (Triton) and dequantize-then-bf16-GEMM, in TFLOP/s;
     each kernel is checked against its torch reference first;
  3. the Engine (CUDA graphs on, triton attention) with bf16 weights / bf16 KV, FP8 weights / bf16 KV,
     FP8 weights / FP8 KV and bf16 weights / FP8 KV: batch-1 decode TPOT at context 512 against the floor
     (bytes one step reads / copy bandwidth), the decode step at batch 64 and 256 (context ~1k), and the
     largest number of 4k-context sequences the KV pool holds.
Weights are dummy (performance does not depend on their values); FP8 weights are quantized at load.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/fp8_h200.py --out $OUT/fp8.json --commit SHA   # H200, < 6 min
    python3 benchmarks/fp8_h200.py --smoke --out /tmp/fp8_smoke.json                    # tiny shapes on the CPU
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

if "--smoke" in sys.argv[1:]:     # a smoke run is the CPU interpreter's, on a machine with a GPU too
    os.environ["TRITON_INTERPRET"] = "1"
import llmserve_core.kernels  # noqa: E402,F401  (the interpreter on CPU for --smoke)
from llmserve_core.kernels.fp8_gemm import (scaled_mm_supported, w8a8_gemm_per_channel,  # noqa: E402
                                            w8a8_gemm_reference, w8a8_gemm_triton)
from llmserve_core.kernels.fp8_gemv import fp8_gemv, fp8_gemv_reference  # noqa: E402
from llmserve_core.kernels.fp8_quant import quantize_activation  # noqa: E402
from llmserve_core.kernels.fp8_format import dequantize_weight, quantize_per_block, quantize_per_channel  # noqa: E402
from qwen3_8b import QWEN3_8B_CONFIG, write_qwen3_8b_dir  # noqa: E402
from floor import StepShape, measure_copy_bandwidth, step_bytes  # noqa: E402
from gemv_bench import launches_us  # noqa: E402

RESULTS: dict = {"meta": {}, "sections": {}}
ROTATE_BYTES = 256 << 20        # weight bytes touched per timed replay: several times the H200's L2
SMOKE_CONFIG = dict(QWEN3_8B_CONFIG, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192)


class Ctx:
    def __init__(self, args):
        self.args = args
        self.smoke = args.smoke
        self.cuda = torch.cuda.is_available() and not args.smoke
        self.device = "cuda" if self.cuda else "cpu"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.deadline = time.time() + args.budget_s
        self.config = SMOKE_CONFIG if self.smoke else QWEN3_8B_CONFIG

    def time_left(self) -> float:
        return self.deadline - time.time()


def section(name, min_share: float = 0.0):
    """A section starts only while min_share of --budget-s is left (shares, not seconds, so a short budget
    still runs every section once the earlier ones are done with theirs)."""
    def wrap(fn):
        def run(ctx, *a):
            if name in ctx.args.skip or ctx.time_left() < min_share * ctx.args.budget_s:
                RESULTS["sections"][name] = {"skipped": "by --skip" if name in ctx.args.skip else "time budget"}
                return None
            t0 = time.time()
            try:
                RESULTS["sections"][name] = fn(ctx, *a)
            except Exception as e:  # a failed section is reported, the rest still runs
                traceback.print_exc()
                RESULTS["sections"][name] = {"error": f"{type(e).__name__}: {e}"}
            RESULTS.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
            save(ctx)
            print(f"== {name} ({RESULTS['seconds'][name]} s): {json.dumps(RESULTS['sections'][name])[:400]}", flush=True)
            return RESULTS["sections"][name]
        return run
    return wrap


def save(ctx):
    os.makedirs(os.path.dirname(os.path.abspath(ctx.args.out)), exist_ok=True)
    with open(ctx.args.out, "w") as f:
        json.dump(RESULTS, f, indent=1)


def time_us(ctx, launches: list, reps: int = 10) -> float:
    """Median microseconds per launch of `launches` run back to back, captured in one CUDA graph (wall
    clock through the interpreter on the CPU)."""
    if not ctx.cuda:
        t0 = time.perf_counter()
        for fn in launches:
            fn()
        return (time.perf_counter() - t0) * 1e6 / len(launches)
    return launches_us(launches, reps)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def timed_shapes(ctx) -> dict[str, tuple[int, int]]:
    shapes = linear_shapes(ctx.config)
    return {k: shapes[k] for k in ("qkv", "down")} if ctx.smoke else shapes


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def decode_bytes(cfg, weight_elem: int, kv_elem: int, context: int) -> int:
    """Bytes one batch-1 decode step at this context must read (benchmarks/floor.py): the projections in
    weight_elem bytes (FP8 with its row scales), everything else in bf16, the K/V in kv_elem bytes."""
    return step_bytes(cfg, StepShape(decode_contexts=(context,)), 2, weight_elem, kv_elem)


# ------------------------------------------------------------------------------------------ sections

@section("copy_bandwidth")
def copy_bandwidth(ctx):
    # floor.py's kernel copy, as every other benchmark measures it: a copy captured in a CUDA graph becomes
    # a memcpy node on the copy engines, which measured 2.77 TB/s here against the 4.25 the SMs reach.
    if not ctx.cuda:
        return {"tb_per_s": 1.0}
    return {"tb_per_s": measure_copy_bandwidth() / 1e12}


def weight_copies(ctx, n, k, make):
    """Enough copies of one weight that a replay streams ROTATE_BYTES from HBM, not from L2."""
    first = make()
    size = sum(t.numel() * t.element_size() for t in (first if isinstance(first, tuple) else (first,)))
    count = 1 if not ctx.cuda else max(2, -(-ROTATE_BYTES // size))
    return [first] + [make() for _ in range(count - 1)]


@section("gemv", min_share=0.55)
def gemv(ctx):
    out = {}
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    for name, (n, k) in timed_shapes(ctx).items():
        w_bf16 = weight_copies(ctx, n, k, lambda: torch.randn(n, k, device=ctx.device, generator=gen).to(ctx.dtype) * 0.02)
        per_channel = [quantize_per_channel(w) for w in w_bf16]
        block = [quantize_per_block(w, (128, 128)) for w in w_bf16]
        for m in ((1,) if ctx.smoke else (1, 16)):
            x = torch.randn(m, k, device=ctx.device, generator=gen).to(ctx.dtype)
            errs = {"channel": rel_err(fp8_gemv(x, *per_channel[0]), fp8_gemv_reference(x, *per_channel[0])),
                    "block": rel_err(fp8_gemv(x, *block[0], (128, 128)), fp8_gemv_reference(x, *block[0], (128, 128)))}
            t_bf16 = time_us(ctx, [lambda w=w: F.linear(x, w) for w in w_bf16] * 2)
            t_ch = time_us(ctx, [lambda q=q, s=s: fp8_gemv(x, q, s) for q, s in per_channel] * 2)
            t_bl = time_us(ctx, [lambda q=q, s=s: fp8_gemv(x, q, s, (128, 128)) for q, s in block] * 2)

            def w8a8(q, s):          # the alternative for few rows: quantize them, then the FP8 tensor-core GEMM
                qa, qs = quantize_activation(x)
                return w8a8_gemm_per_channel(qa, qs, q, s, ctx.dtype)
            t_mm = time_us(ctx, [lambda q=q, s=s: w8a8(q, s) for q, s in per_channel] * 2)
            out[f"{name}_m{m}"] = {
                "n": n, "k": k, "rows": m, "rel_err": errs,
                "bf16_us": t_bf16, "fp8_channel_us": t_ch, "fp8_block_us": t_bl, "fp8_channel_w8a8_us": t_mm,
                "bf16_gb_s": 2 * n * k / t_bf16 / 1e3, "fp8_channel_gb_s": (n * k + 4 * n) / t_ch / 1e3,
                "fp8_block_gb_s": (n * k + 4 * (n // 128) * (k // 128)) / t_bl / 1e3,
                "fp8_channel_w8a8_gb_s": (n * k + 4 * n) / t_mm / 1e3,
                "speedup_channel": t_bf16 / t_ch, "speedup_block": t_bf16 / t_bl, "speedup_channel_w8a8": t_bf16 / t_mm,
            }
        del w_bf16, per_channel, block
        if ctx.cuda:
            torch.cuda.empty_cache()
    return out


@section("gemm", min_share=0.45)
def gemm(ctx):
    out = {"scaled_mm_rowwise": scaled_mm_supported(torch.device(ctx.device), 4096, 4096, torch.bfloat16)}
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    rows = (64, 256, 2048, 8192) if ctx.cuda else (32,)
    for name, (n, k) in timed_shapes(ctx).items():
        w = torch.randn(n, k, device=ctx.device, generator=gen).to(ctx.dtype) * 0.02
        wq, ws = quantize_per_channel(w)
        bq, bs = quantize_per_block(w, (128, 128))
        for m in rows:
            x = torch.randn(m, k, device=ctx.device, generator=gen).to(ctx.dtype)
            a, a_s = quantize_activation(x)
            ab, ab_s = quantize_activation(x, 128)
            errs = {
                "channel": rel_err(w8a8_gemm_per_channel(a, a_s, wq, ws, ctx.dtype),
                                   w8a8_gemm_reference(a, a_s, wq, ws, None, torch.float32)),
                "channel_triton": rel_err(w8a8_gemm_triton(a, a_s, wq, ws, None, ctx.dtype),
                                          w8a8_gemm_reference(a, a_s, wq, ws, None, torch.float32)),
                "block": rel_err(w8a8_gemm_triton(ab, ab_s, bq, bs, (128, 128), ctx.dtype),
                                 w8a8_gemm_reference(ab, ab_s, bq, bs, (128, 128), torch.float32)),
            }
            flop = 2 * m * n * k
            reps = 1 if ctx.smoke else 4

            def channel():
                qa, qs = quantize_activation(x)
                return w8a8_gemm_per_channel(qa, qs, wq, ws, ctx.dtype)

            def channel_triton():
                qa, qs = quantize_activation(x)
                return w8a8_gemm_triton(qa, qs, wq, ws, None, ctx.dtype)

            def block():
                qa, qs = quantize_activation(x, 128)
                return w8a8_gemm_triton(qa, qs, bq, bs, (128, 128), ctx.dtype)

            def dequant_bf16():
                return F.linear(x, dequantize_weight(bq, bs, (128, 128)).to(ctx.dtype))

            times = {"bf16": time_us(ctx, [lambda: F.linear(x, w)] * reps), "fp8_channel": time_us(ctx, [channel] * reps),
                     "fp8_channel_triton": time_us(ctx, [channel_triton] * reps), "fp8_block": time_us(ctx, [block] * reps),
                     "fp8_block_dequant_bf16": time_us(ctx, [dequant_bf16] * 2)}
            out[f"{name}_m{m}"] = {"n": n, "k": k, "rows": m, "rel_err": errs,
                                   **{f"{key}_us": t for key, t in times.items()},
                                   **{f"{key}_tflops": flop / t / 1e6 for key, t in times.items()}}
        w = wq = ws = bq = bs = None
        if ctx.cuda:
            torch.cuda.empty_cache()
    return out


ENGINES = {
    "bf16_w_bf16_kv": dict(),
    "fp8_w_bf16_kv": dict(quantization="fp8"),
    "fp8_w_fp8_kv": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"),
    "bf16_w_fp8_kv": dict(kv_cache_dtype="fp8_e4m3"),
}


def kv_budget_recorder():
    """Record the bytes the model runner's memory profile leaves for KV (its pool is also capped by
    max_num_seqs, so the pool size alone would understate what fits)."""
    from llmserve_core.engine.model_runner import ModelRunner
    seen = []
    original = ModelRunner._profile_free_memory

    def record(self):
        seen.append(original(self))
        return seen[-1]
    ModelRunner._profile_free_memory = record
    return seen, lambda: setattr(ModelRunner, "_profile_free_memory", original)


def decode_steps(engine, count: int) -> float:
    """Median wall ms of `count` engine steps once every running request is decoding."""
    while engine.stats()["waiting"] or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


@section("engine", min_share=0.15)
def engine_section(ctx, model_dir, bandwidth):
    from llmserve_core import Engine, EngineConfig
    from llmserve_proto import SamplingParams
    import random
    out = {}
    rnd = random.Random(0)
    vocab = ctx.config["vocab_size"]

    def prompt(n):
        return [rnd.randrange(vocab // 100, vocab) for _ in range(n)]
    long = SamplingParams(max_tokens=2048, ignore_eos=True)
    ctx_len = 512 if ctx.cuda else 32
    batch_ctx = 1024 if ctx.cuda else 48
    batches = (64, 256) if ctx.cuda else (4, 8)
    budgets, restore = kv_budget_recorder()
    try:
        for name, kw in ENGINES.items():
            if ctx.args.engines and name not in ctx.args.engines:
                continue
            if ctx.time_left() < 45:
                out[name] = {"skipped": "time budget"}
                continue
            t0 = time.time()
            engine = Engine(EngineConfig(model=model_dir, load_format="dummy", device=ctx.device,
                                         max_model_len=4096 + 256, max_num_seqs=max(batches),
                                         max_num_batched_tokens=8192, gpu_memory_utilization=0.90, **kw))
            row = {"load_s": round(time.time() - t0, 1), "graphs": engine.runner.graphs is not None}
            runner = engine.runner
            w_elem = 1 if "quantization" in kw else 2
            kv_elem = runner.kv_caches[0][0].element_size()
            engine.add_request("b1", prompt(ctx_len),
                               SamplingParams(max_tokens=40 if ctx.smoke else 300, ignore_eos=True))
            tpot = decode_steps(engine, 10 if ctx.smoke else 200)
            engine.abort("b1")
            while engine.has_unfinished():
                engine.step()
            floor_ms = decode_bytes(ctx.config, w_elem, kv_elem, ctx_len + 100) / (bandwidth * 1e12) * 1e3
            fp8_floor_ms = decode_bytes(ctx.config, 1, kv_elem, ctx_len + 100) / (bandwidth * 1e12) * 1e3
            row.update(tpot_ms=tpot, floor_ms=floor_ms, fraction_of_floor=floor_ms / tpot,
                       fp8_floor_ms=fp8_floor_ms, fraction_of_fp8_floor=fp8_floor_ms / tpot)
            added = 0
            for b in batches:
                for i in range(added, b):
                    engine.add_request(f"c{i}", prompt(batch_ctx), long)
                added = b
                ms = decode_steps(engine, 5 if ctx.smoke else 30)
                row[f"batch{b}"] = {"step_ms": ms, "tokens_per_s": b * 1e3 / ms}
            for rid in list(engine.requests):
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            per_block = runner.kv_bytes_per_block()
            budget = budgets[-1] if budgets and ctx.cuda else runner.num_blocks * per_block
            blocks = budget // per_block
            row.update(kv_blocks=runner.num_blocks, kv_budget_gib=budget / 2 ** 30,
                       max_seqs_at_4k=int(blocks * runner.block_size // 4096))
            out[name] = row
            print(f"   {name}: {json.dumps(row)}", flush=True)
            del engine, runner
            gc.collect()
            if ctx.cuda:
                torch.cuda.empty_cache()
    finally:
        restore()
    b, f = out.get("bf16_w_bf16_kv", {}), out.get("fp8_w_bf16_kv", {})
    if "tpot_ms" in b and "tpot_ms" in f:
        out["fp8_over_bf16_tpot"] = f["tpot_ms"] / b["tpot_ms"]
    return out


# ------------------------------------------------------------------------------------------ report

def table(ctx) -> str:
    s = RESULTS["sections"]
    lines = [f"FP8 vs bf16, Qwen3-8B shape ({RESULTS['meta'].get('gpu')}, commit {RESULTS['meta'].get('commit')})"]
    bw = s.get("copy_bandwidth", {}).get("tb_per_s")
    if bw:
        lines.append(f"copy bandwidth {bw:.2f} TB/s")
    g = s.get("gemv", {})
    if any(k.endswith(("_m1", "_m16")) for k in g):
        lines.append(f"{'GEMV':<13}{'bf16 us':>9}{'GB/s':>7}{'fp8ch us':>10}{'GB/s':>7}{'fp8blk us':>11}{'GB/s':>7}{'x':>6}"
                     f"{'w8a8 us':>9}{'GB/s':>7}{'x':>6}")
        for key, r in g.items():
            if not isinstance(r, dict) or "bf16_us" not in r:
                continue
            lines.append(f"{key:<13}{r['bf16_us']:>9.1f}{r['bf16_gb_s']:>7.0f}{r['fp8_channel_us']:>10.1f}"
                         f"{r['fp8_channel_gb_s']:>7.0f}{r['fp8_block_us']:>11.1f}{r['fp8_block_gb_s']:>7.0f}"
                         f"{r['speedup_channel']:>6.2f}{r['fp8_channel_w8a8_us']:>9.1f}{r['fp8_channel_w8a8_gb_s']:>7.0f}"
                         f"{r['speedup_channel_w8a8']:>6.2f}")
    m = s.get("gemm", {})
    if any(isinstance(r, dict) and "bf16_tflops" in r for r in m.values()):
        lines.append(f"{'GEMM TFLOP/s':<14}{'bf16':>7}{'fp8ch':>7}{'ch-trit':>8}{'fp8blk':>8}{'deq+bf16':>9}")
        for key, r in m.items():
            if isinstance(r, dict) and "bf16_tflops" in r:
                lines.append(f"{key:<14}{r['bf16_tflops']:>7.0f}{r['fp8_channel_tflops']:>7.0f}"
                             f"{r['fp8_channel_triton_tflops']:>8.0f}{r['fp8_block_tflops']:>8.0f}"
                             f"{r['fp8_block_dequant_bf16_tflops']:>9.0f}")
    e = s.get("engine", {})
    rows = [(k, r) for k, r in e.items() if isinstance(r, dict) and "tpot_ms" in r]
    if rows:
        lines.append(f"{'engine':<16}{'TPOT ms':>8}{'floor':>7}{'%floor':>7}{'%fp8fl':>7}{'b64 tok/s':>10}"
                     f"{'b256 tok/s':>11}{'seqs@4k':>8}")
        for k, r in rows:
            b64 = next((v["tokens_per_s"] for kk, v in r.items() if kk.startswith("batch") and kk != "batch256"
                        and isinstance(v, dict)), float("nan"))
            b256 = r.get("batch256", {}).get("tokens_per_s", float("nan"))
            lines.append(f"{k:<16}{r['tpot_ms']:>8.2f}{r['floor_ms']:>7.2f}{100 * r['fraction_of_floor']:>6.0f}%"
                         f"{100 * r['fraction_of_fp8_floor']:>6.0f}%{b64:>10.0f}{b256:>11.0f}{r['max_seqs_at_4k']:>8}")
        if "fp8_over_bf16_tpot" in e:
            lines.append(f"batch-1 TPOT fp8 / bf16 = {e['fp8_over_bf16_tpot']:.2f}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--budget-s", type=float, default=330.0, help="stop starting sections after this many seconds")
    p.add_argument("--skip", nargs="*", default=[], choices=["gemv", "gemm", "engine"])
    p.add_argument("--commit", default=None, help="the commit to name (default: git rev-parse, where there is a .git)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, times nothing real")
    p.add_argument("--engines", nargs="*", default=[], choices=list(ENGINES),
                   help="the engine section's weight / KV dtypes to run (default: all four)")
    args = p.parse_args()
    ctx = Ctx(args)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip()
    RESULTS["meta"] = {"commit": commit or "unknown", "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name() if ctx.cuda else "cpu (smoke)", "smoke": args.smoke}
    try:
        import triton
        RESULTS["meta"]["triton"] = triton.__version__
    except ImportError:
        pass
    bw = (copy_bandwidth(ctx) or {}).get("tb_per_s", 4.0)
    gemv(ctx)
    gemm(ctx)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_qwen3_8b_dir(os.path.join(tmp, "qwen3-8b"), **(SMOKE_CONFIG if ctx.smoke else {}))
        engine_section(ctx, model_dir, bw)
    RESULTS["table"] = table(ctx)
    save(ctx)
    print(RESULTS["table"])


if __name__ == "__main__":
    main()
