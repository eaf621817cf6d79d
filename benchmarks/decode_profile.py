"""Decode steps of the Qwen3-8B shape as the engine runs them: step time against the honest floor, and
the kernels each step launches (per layer, with times), at batch 1, 64 and 256.

The floor of a decode step over B sequences at context c is benchmarks/floor.py's: max(bytes / copy
bandwidth, FLOPs / bf16 peak), both ceilings measured in the same run. Bytes: every weight except the
embedding table (a step reads B of its rows), plus the KV of B * c tokens read and B written. FLOPs: 2 per
weight per row, plus attention's 4 * c * heads * head_dim per row and layer.

Step times are wall-clock medians of Engine.step() in steady decoding (host work included); the kernel
list comes from one profiled stretch of steps (CUDA graph replays included).

    python benchmarks/decode_profile.py --label now --out $OUT/decode_now.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from floor import decode_floor, measure_bf16_peak, measure_copy_bandwidth  # noqa: E402
from qwen3_8b import QWEN3_8B_CONFIG, write_qwen3_8b_dir  # noqa: E402

C = QWEN3_8B_CONFIG


def step_floor_ms(batch: int, ctx: int, bw: float, peak: float) -> dict:
    """benchmarks/floor.py's floor of a decode step over `batch` rows at context `ctx`."""
    f = decode_floor(C, [ctx] * batch, bw, peak)
    return {"bytes": f.bytes, "flops": f.flops, "bytes_ms": f.memory_ms, "flops_ms": f.compute_ms,
            "floor_ms": f.ms}


def category(name: str) -> str:
    n = name.lower()
    if "gemv" in n or "gemm" in n or "nvjet" in n or "cutlass" in n or "xmma" in n or "splitk" in n:
        return "gemm"
    if "_decode_kernel" in n or "_prefill_kernel" in n or "flash" in n or "attn" in n or "fmha" in n:
        return "attention"
    return "other"


def profile_steps(engine, steps: int) -> tuple[list[tuple[str, float, float]], float]:
    """(kernels as (name, start_us, dur_us), wall ms) over `steps` engine steps."""
    return profile_calls(engine.step, steps)


def profile_calls(fn, calls: int) -> tuple[list[tuple[str, float, float]], float]:
    """(kernels as (name, start_us, dur_us), wall ms) over `calls` calls of fn()."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    kernels = sorted((e["name"], e["ts"], e["dur"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    return sorted(kernels, key=lambda k: k[1]), wall


def busy_us(kernels) -> float:
    busy, cur_s, cur_e = 0.0, None, None
    for _, s, d in kernels:
        e = s + d
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + ((cur_e - cur_s) if cur_e is not None else 0.0)


def summarize(kernels, calls: int) -> dict:
    """Per call: kernel count, GPU ms by kind, busy ms (the union of kernel intervals) and every kernel
    name's calls and microseconds, longest first."""
    per_name = collections.defaultdict(lambda: [0, 0.0])
    by_kind = collections.Counter()
    for name, _, dur in kernels:
        per_name[name][0] += 1
        per_name[name][1] += dur
        by_kind[category(name)] += dur
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    return {"kernels_per_step": len(kernels) / calls,
            "gpu_ms_by_kind": {k: v / calls / 1e3 for k, v in by_kind.items()},
            "busy_ms_per_step": busy_us(kernels) / calls / 1e3,
            "kernels": [{"name": n[:90], "calls": c / calls, "us": t / calls} for n, (c, t) in rows]}


def run_batch(model_dir: str, batch: int, ctx: int, bw: float, peak: float, steps: int, eager: bool) -> dict:
    from llmserve_core import Engine, EngineConfig
    from llmserve_proto import SamplingParams
    engine = Engine(EngineConfig(model=model_dir, load_format="dummy", max_model_len=ctx + 1100,
                                 max_num_seqs=max(batch, 1), max_num_batched_tokens=8192,
                                 gpu_memory_utilization=0.85, enforce_eager=eager, warmup=False))
    params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(f"r{i}", [(1000 + 7 * i + j) % 150000 for j in range(ctx)], params)
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    for _ in range(10):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    step_ms = statistics.median(times)
    prof_steps = 10
    kernels, wall = profile_steps(engine, prof_steps)
    summary = summarize(kernels, prof_steps)
    busy = busy_us(kernels)
    span = kernels[-1][1] + kernels[-1][2] - kernels[0][1] if kernels else 0.0
    floor = step_floor_ms(batch, ctx + 10 + steps, bw, peak)
    del engine
    torch.cuda.empty_cache()
    return {
        "batch": batch, "ctx": ctx, "eager": eager, "step_ms": step_ms, "step_ms_p10": sorted(times)[len(times) // 10],
        **floor, "fraction_of_floor": floor["floor_ms"] / step_ms,
        "kernels_per_step": summary["kernels_per_step"], "gpu_ms_per_step": summary["gpu_ms_by_kind"],
        "busy_ms_per_step": summary["busy_ms_per_step"], "idle_fraction": 1 - busy / span if span else None,
        "kernel_table": summary["kernels"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="now")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    bw, peak = measure_copy_bandwidth(), measure_bf16_peak()
    model_dir = write_qwen3_8b_dir(tempfile.mkdtemp())
    res = {"label": args.label, "copy_bandwidth_tb_s": bw / 1e12, "bf16_peak_tflops": peak / 1e12, "runs": []}
    for b in map(int, args.batches.split(",")):
        r = run_batch(model_dir, b, args.ctx, bw, peak, args.steps, args.eager)
        res["runs"].append(r)
        print(f"[{args.label}] batch {b}: step {r['step_ms']:.3f} ms, floor {r['floor_ms']:.3f} ms "
              f"({100 * r['fraction_of_floor']:.0f}%), {r['kernels_per_step']:.0f} kernels/step, GPU busy "
              f"{r['busy_ms_per_step']:.3f} ms {json.dumps({k: round(v, 3) for k, v in r['gpu_ms_per_step'].items()})}",
              flush=True)
        for row in r["kernel_table"][:14]:
            print(f"    {row['calls']:7.1f} x {row['us'] / max(row['calls'], 1):8.2f} us = {row['us']:9.1f} us  {row['name']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
