"""The GPU's kernels over some calls, from the torch profiler, and what the benchmarks read off them:
each kernel's kind, the GPU's busy time (the union of kernel intervals: overlapping kernels, as under PDL,
count once) and a per-call summary. decode_profile, spec_timing, h200_e2e and grammar_mask_cost report
from here, so their busy and idle figures mean the same thing.

A kernel is (name, start_us, dur_us), in the order the GPU started them.
"""
from __future__ import annotations

import collections
import json
import os
import tempfile
import time

import torch

# Chrome-trace categories of work the GPU does: kernels, and the copies and fills between them.
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
KINDS = ("gemm", "attention", "other")


def profile_calls(fn, calls: int) -> tuple[list[tuple[str, float, float]], float]:
    """(kernels, wall ms) over `calls` calls of fn(), the device synchronized before and after. Without a
    GPU (a smoke run on the CPU) there are no kernels to list."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU] if cuda else [ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
               if e.get("ph") == "X" and e.get("cat") in GPU_WORK]
    return sorted(kernels, key=lambda k: k[1]), wall


def kernel_kind(name: str) -> str:
    """"gemm", "attention" or "other", from the kernel's name (ours, cuBLAS's, CUTLASS's, FlashAttention's).
    Attention is asked first: FlashAttention's kernels are CUTLASS kernels, and their names say so."""
    n = name.lower()
    if any(k in n for k in ("_decode_kernel", "_prefill_kernel", "flash", "attn", "fmha")):
        return "attention"
    if any(k in n for k in ("gemv", "gemm", "w8a8", "nvjet", "cutlass", "xmma", "matmul", "splitk")):
        return "gemm"
    return "other"


def busy_us(kernels) -> float:
    """Length of the union of the kernels' intervals."""
    busy, cur_s, cur_e = 0.0, None, None
    for _, s, d in sorted(kernels, key=lambda k: k[1]):
        e = s + d
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + ((cur_e - cur_s) if cur_e is not None else 0.0)


def span_us(kernels) -> float:
    """From the first kernel's start to the last one's end."""
    if not kernels:
        return 0.0
    return max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)


def frontier_us(kernels) -> list[float]:
    """What each kernel adds to the GPU's busy time: how far its end moves the end of all work started
    before it, less any idle gap it closes. Under PDL a kernel starts while the one before still runs and
    waits; its summed duration counts that wait, this does not. The values sum to busy_us(kernels).
    kernels in start order (as profile_calls returns them); the values come in the same order."""
    out, frontier = [], None
    for _, s, d in kernels:          # in start order
        e = s + d
        if frontier is None or s >= frontier:
            out.append(d)
        else:
            out.append(max(0.0, e - frontier))
        frontier = e if frontier is None else max(frontier, e)
    return out


def idle_gaps(kernels, calls: int, top: int = 10) -> list[dict]:
    """Where the GPU idles: each gap between the end of all work started so far and the next kernel's
    start, summed per (the kernel that ended last, the kernel after the gap), per call, longest first."""
    gaps = collections.defaultdict(lambda: [0, 0.0])
    frontier, last = None, None
    for name, s, d in sorted(kernels, key=lambda k: k[1]):
        if frontier is not None and s > frontier:
            gap = gaps[(last[:60], name[:60])]
            gap[0] += 1
            gap[1] += s - frontier
        if frontier is None or s + d >= frontier:
            frontier, last = s + d, name
    rows = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"after": a, "before": b, "count": c / calls, "us": t / calls} for (a, b), (c, t) in rows]


def summarize(kernels, calls: int) -> dict:
    """Per call: kernel count, GPU ms by kind (summed durations), busy ms, and every kernel name's calls,
    summed microseconds (longest first) and frontier microseconds (frontier_us: its share of the busy
    time). Over the whole stretch: the idle fraction of its span."""
    per_name = collections.defaultdict(lambda: [0, 0.0, 0.0])
    by_kind = collections.Counter()
    kernels = sorted(kernels, key=lambda k: k[1])
    for (name, _, dur), front in zip(kernels, frontier_us(kernels)):
        per_name[name][0] += 1
        per_name[name][1] += dur
        per_name[name][2] += front
        by_kind[kernel_kind(name)] += dur
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    busy, span = busy_us(kernels), span_us(kernels)
    return {"kernels_per_step": len(kernels) / calls,
            "gpu_ms_by_kind": {k: v / calls / 1e3 for k, v in by_kind.items()},
            "busy_ms_per_step": busy / calls / 1e3,
            "idle_fraction": 1 - busy / span if span else None,
            "idle_gaps": idle_gaps(kernels, calls),
            "kernels": [{"name": n[:90], "calls": c / calls, "us": t / calls, "frontier_us": f / calls}
                        for n, (c, t, f) in rows]}
