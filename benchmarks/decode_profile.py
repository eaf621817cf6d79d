"""Decode steps of the Qwen3-8B shape as the engine runs them: step time against the honest floor, and
the kernels each step launches (per layer, with times), at batch 1, 64 and 256.

The floor of a decode step over B sequences at context c is benchmarks/floor.py's: max(bytes / copy
bandwidth, FLOPs / bf16 peak), both ceilings measured in the same run. Bytes: every weight except the
embedding table (a step reads B of its rows), plus the KV of B * c tokens read and B written. FLOPs: 2 per
weight per row, plus attention's 4 * c * heads * head_dim per row and layer.

With `--quantization fp8` the weights are quantized at load, and with `--block-scaled` the model directory is
a Qwen FP8 checkpoint's (128 x 128 block scales, dummy weights quantized as it would be); either way the floor
counts the projections at one byte a weight (plus their scales); with `--kv-cache-dtype fp8_e4m3` the K/V at one byte an element.

Step times are wall-clock medians of Engine.step() in steady decoding (host work included), each held
against the floor at the timed steps' middle context (`--ctx 512`: the timed steps attend 523-582 keys, the
floor 552); the kernel list comes from the profiled stretch after them (583-592 keys; CUDA graph replays
included), so its attention reads a little more than the median timed step's.

Each timed step is also split into the time step() spends blocked on the device (waiting for the step
before to come back, StepHandle._wait) and the rest, the host's work: a step whose host time is its whole
wall time starves the GPU, however fast its kernels. `--host-profile` runs that many more steps under
cProfile and keeps the host functions that took the most time.

    python benchmarks/decode_profile.py --label now --out $OUT/decode_now.json
    python benchmarks/decode_profile.py --label fp8 --out $OUT/decode_fp8.json --batches 1 --quantization fp8
    python benchmarks/decode_profile.py --smoke --out /tmp/decode_smoke.json      # tiny model on the CPU
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from floor import decode_floor, measure_bf16_peak, measure_copy_bandwidth  # noqa: E402
from kernel_trace import profile_calls, summarize  # noqa: E402
from qwen3_8b import QWEN3_8B_CONFIG, QWEN_FP8_BLOCK_CONFIG, smoke_shape, write_qwen3_8b_dir  # noqa: E402

C = QWEN3_8B_CONFIG
WARM_STEPS = 10         # decode steps after the prefills, before the timed ones
PROFILED_STEPS = 10     # after the timed ones: the kernel table's stretch
MAX_DECODE_STEPS = 1000  # each request's max_tokens: warm, timed, host-profiled and profiled steps must fit
ENGINE = dict(load_format="dummy", gpu_memory_utilization=0.85)     # what every run's EngineConfig adds
SMOKE_RATES = (1e11, 1e12)     # bytes/s and FLOP/s a smoke run's floors assume (nothing is measured there)


def use_smoke_model(tmp: str, **overrides) -> str:
    """A smoke run: the tiny model's shape (config.json, `overrides` on top) on the CPU, short runs. Sets this
    module's shape and engine settings for every run_batch after it; returns the model directory."""
    global C, WARM_STEPS, PROFILED_STEPS, MAX_DECODE_STEPS
    shape = smoke_shape()
    C = dict(QWEN3_8B_CONFIG, **shape)
    WARM_STEPS, PROFILED_STEPS, MAX_DECODE_STEPS = 2, 2, 100
    ENGINE.update(device="cpu", num_kv_blocks=256)
    return write_qwen3_8b_dir(tmp, **shape, **overrides)


def step_floor_ms(batch: int, ctx: int, bw: float, peak: float, linear_bytes: int = 2, kv_bytes: int = 2) -> dict:
    """benchmarks/floor.py's floor of a decode step over `batch` rows at context `ctx`."""
    f = decode_floor(C, [ctx] * batch, bw, peak, 2, linear_bytes, kv_bytes)
    return {"bytes": f.bytes, "flops": f.flops, "bytes_ms": f.memory_ms, "flops_ms": f.compute_ms,
            "floor_ms": f.ms}


class DeviceWaits:
    """Seconds Engine.step() has spent blocked on the device (StepHandle._wait) since entering."""

    def __enter__(self) -> "DeviceWaits":
        from llmserve_core.engine.step_result import StepHandle
        self.total, self._handle_cls, self._wait = 0.0, StepHandle, StepHandle._wait

        def timed_wait(handle) -> None:
            t0 = time.perf_counter()
            self._wait(handle)
            self.total += time.perf_counter() - t0
        StepHandle._wait = timed_wait
        return self

    def __exit__(self, *exc) -> None:
        self._handle_cls._wait = self._wait


def host_profile(step, steps: int, top: int = 25) -> list[dict]:
    """The host functions that took the most time (their own, not their callees') over `steps` steps."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = [{"function": f"{Path(file).name}:{line} {fn}", "calls": nc / steps, "own_us": tt / steps * 1e6,
             "cumulative_us": ct / steps * 1e6}
            for (file, line, fn), (_, nc, tt, ct, _) in stats.stats.items()]
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def run_batch(model_dir: str, batch: int, ctx: int, bw: float, peak: float, steps: int, eager: bool,
              quantization: str | None = None, kv_cache_dtype: str = "auto", fp8_weights: bool = False,
              host_profile_steps: int = 0) -> dict:
    from llmserve_core import Engine, EngineConfig
    from llmserve_proto import SamplingParams
    engine = Engine(EngineConfig(model=model_dir, max_model_len=ctx + MAX_DECODE_STEPS + 100,
                                 max_num_seqs=max(batch, 1), max_num_batched_tokens=8192,
                                 enforce_eager=eager, warmup=False,
                                 quantization=quantization, kv_cache_dtype=kv_cache_dtype, **ENGINE))
    params = SamplingParams(max_tokens=MAX_DECODE_STEPS, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(f"r{i}", [(1000 + 7 * i + j) % C["vocab_size"] for j in range(ctx)], params)
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()
    all_running(engine, batch)
    times, waits = [], []
    with DeviceWaits() as blocked:
        for _ in range(steps):
            t0, w0 = time.perf_counter(), blocked.total
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
            waits.append((blocked.total - w0) * 1e3)
    step_ms = statistics.median(times)
    host = host_profile(engine.step, host_profile_steps) if host_profile_steps else []
    kernels, _ = profile_calls(engine.step, PROFILED_STEPS)
    summary = summarize(kernels, PROFILED_STEPS)
    all_running(engine, batch)
    timed, profiled = attended_keys(ctx, steps, host_profile_steps)
    # The floor of the median step: the timed steps attend timed[0]..timed[1] keys, so their middle.
    floor = step_floor_ms(batch, round(sum(timed) / 2), bw, peak, 1 if quantization or fp8_weights else 2,
                          1 if kv_cache_dtype == "fp8_e4m3" else 2)
    # The engine holds reference cycles (and its graphs' memory pools): collect them now, or the next batch's
    # engine sizes its KV pool around this one's leftovers (batch 256 after 64 and 128 once found no room).
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "batch": batch, "ctx": ctx, "timed_keys": timed, "profiled_keys": profiled, "eager": eager, "quantization": quantization or ("fp8-block" if fp8_weights else None), "kv_cache_dtype": kv_cache_dtype, "step_ms": step_ms, "step_ms_p10": sorted(times)[len(times) // 10],
        **floor, "fraction_of_floor": floor["floor_ms"] / step_ms,
        "kernels_per_step": summary["kernels_per_step"], "gpu_ms_per_step": summary["gpu_ms_by_kind"],
        "busy_ms_per_step": summary["busy_ms_per_step"], "idle_fraction": summary["idle_fraction"],
        "kernel_table": summary["kernels"], "idle_gaps": summary["idle_gaps"],
        "device_wait_ms": statistics.median(waits),
        "host_ms": statistics.median(t - w for t, w in zip(times, waits)), "host_profile": host,
    }


def attended_keys(ctx: int, steps: int, between: int = 0) -> tuple[list[int], list[int]]:
    """The keys each sequence attends in the first and last timed step, and in the first and last profiled
    one. Decode step j after a ctx-token prefill feeds token ctx + j (sampled by the step before) and
    attends ctx + j keys; WARM_STEPS steps come before the timed ones, `between` (the host profile's)
    between them and the PROFILED_STEPS."""
    first = ctx + WARM_STEPS + 1
    profiled = first + steps + between
    return [first, first + steps - 1], [profiled, profiled + PROFILED_STEPS - 1]


def all_running(engine, batch: int) -> None:
    """A step over `batch` rows only if every request is decoding: a KV pool too small for them all leaves
    some waiting (or preempted), and the steps then run fewer rows than the floor is computed for."""
    running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
    if running != batch or waiting:
        raise RuntimeError(f"batch {batch}: {running} requests running and {waiting} waiting; the KV pool "
                           f"({engine.stats()['total_kv_blocks']} blocks) does not hold the batch")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="now")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="quantize the weights at load")
    ap.add_argument("--block-scaled", action="store_true",
                    help="a Qwen FP8 checkpoint's config (128 x 128 block scales) instead of a bf16 one")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    ap.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                    help="after the timed steps, run STEPS more under cProfile and keep the costliest host functions")
    ap.add_argument("--smoke", action="store_true", help="the tiny model's shape on the CPU (checks the script runs)")
    args = ap.parse_args()
    block = {"quantization_config": QWEN_FP8_BLOCK_CONFIG} if args.block_scaled else {}
    if args.smoke:     # the tiny shape's widths take 16-wide scale blocks, which only the CPU accepts
        block = {"quantization_config": dict(QWEN_FP8_BLOCK_CONFIG, weight_block_size=[16, 16])} if block else {}
        model_dir = use_smoke_model(tempfile.mkdtemp(), **block)
    if args.steps < 1 or args.host_profile < 0 or \
            WARM_STEPS + args.steps + args.host_profile + PROFILED_STEPS > MAX_DECODE_STEPS:
        ap.error(f"--steps (1 or more) and --host-profile (0 or more) must leave the warm-up's and the profile's "
                 f"{WARM_STEPS + PROFILED_STEPS} steps room in {MAX_DECODE_STEPS} (got {args.steps} and {args.host_profile})")
    if args.quantization and args.block_scaled:
        ap.error("--quantization fp8 quantizes a bf16 checkpoint; --block-scaled is an FP8 one already")
    if args.smoke:
        bw, peak = SMOKE_RATES
    else:
        bw, peak = measure_copy_bandwidth(), measure_bf16_peak()
        model_dir = write_qwen3_8b_dir(tempfile.mkdtemp(), **block)
    res = {"label": args.label, "copy_bandwidth_tb_s": bw / 1e12, "bf16_peak_tflops": peak / 1e12, "runs": []}
    for b in map(int, args.batches.split(",")):
        r = run_batch(model_dir, b, args.ctx, bw, peak, args.steps, args.eager, args.quantization,
                      args.kv_cache_dtype, fp8_weights=args.block_scaled, host_profile_steps=args.host_profile)
        res["runs"].append(r)
        print(f"[{args.label}] batch {b}: step {r['step_ms']:.3f} ms, floor {r['floor_ms']:.3f} ms "
              f"({100 * r['fraction_of_floor']:.0f}%), {r['kernels_per_step']:.0f} kernels/step, GPU busy "
              f"{r['busy_ms_per_step']:.3f} ms {json.dumps({k: round(v, 3) for k, v in r['gpu_ms_per_step'].items()})}",
              flush=True)
        print(f"    host {r['host_ms']:.3f} ms a step, blocked on the device {r['device_wait_ms']:.3f} ms")
        for row in r["host_profile"][:12]:
            print(f"    host {row['own_us']:8.1f} us own, {row['cumulative_us']:8.1f} us cumulative, "
                  f"{row['calls']:5.1f} calls  {row['function']}")
        for gap in r["idle_gaps"][:8]:
            print(f"    idle {gap['us']:7.1f} us in {gap['count']:5.1f} gaps after {gap['after'][:40]} before {gap['before'][:40]}")
        for row in r["kernel_table"][:14]:
            print(f"    {row['calls']:7.1f} x {row['us'] / max(row['calls'], 1):8.2f} us = {row['us']:9.1f} us "
                  f"(frontier {row['frontier_us']:8.1f} us)  {row['name']}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))      # after each batch: a later failure keeps these


if __name__ == "__main__":
    main()
