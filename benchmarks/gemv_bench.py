"""The skinny matmul at Qwen3-8B's decode shapes: cuBLAS (F.linear) against kernels.gemv, and a sweep of
gemv tile configs (--sweep: the parameters of kernels/gemv.split_k_tile's rule, the tile a card without a
tuned table gets), as achieved weight-read bandwidth against the copy bandwidth measured in the same run.

Each shape rotates over enough weight copies to exceed the 60 MB L2, so every timed call reads its
weight from HBM. Times are triton.testing.do_bench medians.

    python benchmarks/gemv_bench.py --out $OUT/gemv.json            # on the GPU
    python benchmarks/gemv_bench.py --sweep --out $OUT/gemv.json    # also try every config in CONFIGS
    python benchmarks/gemv_bench.py --smoke --sweep                 # tiny shapes, CPU interpreter

Its timing helpers (graph_us, launches_us, bench, copy_bandwidth) serve the other kernel benchmarks too.
Under Triton's interpreter (their smoke runs) they time eagerly on the CPU: the figures mean nothing there,
the run only shows that the script still works.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv[1:]:     # a smoke run is the CPU interpreter's, on a machine with a GPU too
    os.environ["TRITON_INTERPRET"] = "1"

from llmserve_core.kernels.gemv import gemv, gemv_reference, split_k_tile  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
ROWS = (1, 2, 4, 8, 16)


SMOKE_SHAPES = {"qkv": (96, 64), "lm_head": (160, 64)}
SWEEP_SHAPES = ("qkv", "o_proj", "down", "lm_head")     # the distinct (N, K) regimes
SWEEP_ROWS = (1, 4, 16)
GRAPH_CALLS = 24


def eager_timing() -> bool:
    """Under the interpreter (or without a GPU) nothing can be captured: time eager calls on the CPU."""
    return os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()


def sweep_configs(m: int, n: int, k: int, sms: int):
    for bn, bk, w, s in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4)):
        if bn * bk <= 16384:
            yield split_k_tile(m, n, k, sms, block_n=bn, block_k=bk, num_warps=w, num_stages=s)


def copy_bandwidth() -> float:
    if eager_timing():
        x = torch.empty(1 << 24, dtype=torch.uint8)
        t0 = time.perf_counter()
        x.clone()
        return 2 * x.numel() / (time.perf_counter() - t0)
    from triton.testing import do_bench
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=200, return_mode="median")
    return 2 * x.numel() / (ms / 1e3)


def graph_us(run, per: int, replays: int = 20) -> tuple[float, object]:
    """(median microseconds per `per` units of one CUDA-graph replay of run(), the captured output)."""
    if eager_timing():
        t0 = time.perf_counter()
        out = run()
        return (time.perf_counter() - t0) * 1e6 / per, out
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    del graph
    return sorted(times)[len(times) // 2], captured


def warm_up_on_side_stream(launches: list) -> None:
    """Run each launch once on a side stream, as capturing cuBLAS wants before a graph takes it."""
    if eager_timing():
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in launches:
            fn()
    torch.cuda.current_stream().wait_stream(side)


def launches_us(launches: list, reps: int = 7) -> float:
    """Median microseconds per launch of `launches` run back to back in one CUDA graph, each warmed up
    first, eagerly and on a side stream."""
    for fn in launches:
        fn()
    if not eager_timing():
        torch.cuda.synchronize()
    warm_up_on_side_stream(launches)
    return graph_us(lambda: [fn() for fn in launches], len(launches), reps)[0]


def bench(fn_for, copies: int, replays: int = 10) -> float:
    """Milliseconds per call inside a CUDA graph of GRAPH_CALLS back-to-back calls cycling over the weight
    copies: launch gaps count as they do in a captured decode step, and no call finds its weight in L2."""
    if eager_timing():        # one call: the interpreter's time means nothing
        return graph_us(lambda: fn_for(0), 1)[0] / 1e3
    for i in range(copies):
        fn_for(i)
    torch.cuda.synchronize()
    us, _ = graph_us(lambda: [fn_for(j % copies) for j in range(GRAPH_CALLS)], GRAPH_CALLS, replays)
    return us / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default=None, help=f"some of {','.join(SHAPES)} (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and one sweep tile on the CPU interpreter")
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    dev, dt = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    sms = 4 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    results = {"copy_bandwidth_tb_s": bw / 1e12, "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
               "rows": {}}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name in args.shapes.split(",") if args.shapes else shapes:
        n, k = shapes[name]
        copies = 1 if args.smoke else max(3, -(-256 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(copies)]
        nbytes = n * k * 2
        for m in (1, 16) if args.smoke else ROWS:
            x = torch.randn(m, k, device=dev, dtype=dt)
            row = {"cublas_ms": bench(lambda i: F.linear(x, ws[i]), copies)}
            row["gemv_ms"] = bench(lambda i: gemv(x, ws[i]), copies)
            err = ((gemv(x, ws[0]).float() - gemv_reference(x.double(), ws[0].double()).float()).norm()
                   / gemv_reference(x.double(), ws[0].double()).float().norm()).item()
            row["gemv_rel_err"] = err
            if args.sweep and name in SWEEP_SHAPES and m in SWEEP_ROWS:
                best = None
                configs = list(sweep_configs(m, n, k, sms))
                for cfg in configs[:1] if args.smoke else configs:
                    try:
                        ms = bench(lambda i: gemv(x, ws[i], config=cfg), copies, replays=3)
                    except Exception as e:          # a config the compiler rejects (registers, shared memory)
                        print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                        continue
                    if best is None or ms < best[0]:
                        best = (ms, cfg)
                row["sweep_best_ms"], row["sweep_best_config"] = best
            for key in ("cublas_ms", "gemv_ms", "sweep_best_ms"):
                if key in row:
                    row[key.replace("_ms", "_tb_s")] = nbytes / (row[key] / 1e3) / 1e12
            results["rows"][f"{name}_m{m}"] = row
            print(f"{name:8s} m={m:2d} " + " ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}"
                                                      for k_, v in row.items()), flush=True)
        del ws
        if not args.smoke:
            torch.cuda.empty_cache()
    print("\n| shape | rows | cuBLAS TB/s | gemv TB/s | gemv % copy | best sweep TB/s |")
    print("|---|---|---|---|---|---|")
    for key, r in results["rows"].items():
        name, m = key.rsplit("_m", 1)
        print(f"| {name} | {m} | {r['cublas_tb_s']:.2f} | {r['gemv_tb_s']:.2f} | {100 * r['gemv_tb_s'] * 1e12 / bw:.0f}% "
              f"| {r.get('sweep_best_tb_s', float('nan')):.2f} |")
    for key, r in results["rows"].items():
        if "sweep_best_config" in r:
            print(key, f"{r['sweep_best_tb_s']:.2f} TB/s", r["sweep_best_config"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
