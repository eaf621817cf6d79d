"""End-to-end speed of llmserve on one GPU, Qwen3-8B shapes with dummy weights, in one run.

Measures, each as a ratio taken in this same run:
  1. the card's device-to-device copy bandwidth and its bf16 matmul peak (the two rates of the floor,
     benchmarks/floor.py: max(bytes / bandwidth, FLOPs / peak));
  2. batch-1 decode time per token vs its floor (layers, final norm, lm_head, one embedding row, KV);
  3. decode step time at batch 64 and 256 (about 640 context) vs its floor, with the GPU time split into
     GEMMs, attention, the rest and idle (torch profiler, kernel intervals);
  4. closed-loop output throughput over IPC (llmserve-core + llmserve-bench) at several concurrencies;
  5. the same workloads through transformers' generate and its continuous-batching generate_batch;
  6. ITL p99 for an 80% 128/128 + 20% 4096/128 mix with chunked prefill on and off;
and, for every timed run, how many kernels the engine JIT-compiled inside it (the stats key
jit_compilations): any at all fails the run (exit status 1), since the start-up warm-up should leave none.
Usage: python benchmarks/h200_e2e.py --out DIR [--quick] [--skip SECTION ...]
       python benchmarks/h200_e2e.py --out DIR --smoke      # every section on the tiny shape, CPU, seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from floor import decode_floor, measure_bf16_peak, measure_copy_bandwidth  # noqa: E402
from kernel_trace import KINDS, busy_us, kernel_kind, profile_calls, span_us  # noqa: E402
from qwen3_8b import QWEN3_8B_CONFIG, smoke_shape, write_qwen3_8b_dir  # noqa: E402
from llmserve_client.child_process import die_with_parent  # noqa: E402

RESULTS: dict = {}
# The sizes of every section: the 8B shape on the GPU, or (--smoke) the tiny shape on the CPU for seconds.
P = dict(
    config=QWEN3_8B_CONFIG, device="cuda", dtype=torch.bfloat16, vocab=(1000, 100000),
    engine=dict(load_format="dummy", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
                gpu_memory_utilization=0.85),
    core=["--gpu-memory-utilization", "0.85"], loop_len=4096, loop_seqs=256,
    b1_contexts=(512, 4096 - 300), b1_tokens=200, step_batches=(64, 256), step_prompt=512, step_context=630,
    steps=20, prompt=512, output=256, windows=((3, 6), (5, 15)), mix_windows=((3, 8), (5, 20)),
    mix="0.8:128:128,0.2:4096:128", mix_len=4400, mix_seqs=128, mix_budget=2048,
    peer=((1, 64), (8, 128), (64, 128)), peer_prompt=512,
)
SMOKE = dict(
    device="cpu", dtype=torch.float32, vocab=(3, 1024),     # config: the tiny shape, set by main()
    engine=dict(load_format="dummy", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256,
                device="cpu", num_kv_blocks=256),
    core=["--device", "cpu", "--num-kv-blocks", "256"], loop_len=512, loop_seqs=4,
    b1_contexts=(16,), b1_tokens=8, step_batches=(2,), step_prompt=16, step_context=18, steps=2, prompt=16,
    output=8, windows=((0.5, 1), (0.5, 1)), mix_windows=((0.5, 1), (0.5, 1)), mix="0.8:16:8,0.2:64:8",
    mix_len=128, mix_seqs=4, mix_budget=32, peer=((1, 4), (2, 4)), peer_prompt=16,
)


SECTIONS: list[str] = []    # every section's name, in run order: what --skip may name


def section(name):
    SECTIONS.append(name)

    def wrap(fn):
        def run(args, *a):
            if name in args.skip:
                return
            t0 = time.time()
            try:
                RESULTS[name] = fn(args, *a)
            except Exception as e:  # a failed section is reported, the rest still runs
                import traceback
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
            RESULTS.setdefault("_seconds", {})[name] = round(time.time() - t0, 1)
            print(f"== {name}: {json.dumps(RESULTS[name])[:600]}", flush=True)
        return run
    return wrap


@section("copy_bandwidth")
def copy_bandwidth(args):
    return {"tb_per_s": 0.1 if args.smoke else measure_copy_bandwidth() / 1e12}


@section("bf16_peak")
def bf16_peak(args):
    return {"tflop_per_s": 1.0 if args.smoke else measure_bf16_peak() / 1e12}


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rates() -> tuple[float, float]:
    """(bytes/s, FLOP/s) measured in this run; the H200's usual values if a section failed."""
    bw = RESULTS.get("copy_bandwidth", {}).get("tb_per_s", 4.2)
    peak = RESULTS.get("bf16_peak", {}).get("tflop_per_s", 790.0)
    return bw * 1e12, peak * 1e12


def make_engine(model_dir, **kw):
    from llmserve_core import Engine, EngineConfig
    cfg = dict(model=model_dir, **P["engine"])
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


@section("batch1_decode")
def batch1_decode(args, model_dir):
    from llmserve_proto import SamplingParams
    bw, peak = rates()
    out = {}
    for backend in ("triton",):
        engine = make_engine(model_dir, **({} if args.smoke else dict(attention_backend=backend, max_num_seqs=64)))
        for ctx in P["b1_contexts"]:
            engine.add_request(f"r{ctx}", [P["vocab"][0] + i for i in range(ctx)],
                               SamplingParams(max_tokens=P["b1_tokens"], ignore_eos=True))
            engine.step()                              # prefill
            jit0 = engine.stats()["jit_compilations"]
            times = []
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            times = sorted(times[5:])
            per_tok = times[len(times) // 2]
            # The mean context over the decoded tokens.
            floor = decode_floor(P["config"], [ctx + P["b1_tokens"] // 2], bw, peak)
            out[f"{backend}_ctx{ctx}"] = {"ms_per_token": per_tok * 1e3, "floor_ms": floor.ms,
                                          "fraction_of_floor": floor.ms / (per_tok * 1e3),
                                          "jit_compilations": engine.stats()["jit_compilations"] - jit0}
        del engine
        free_device_memory()
    return out


@section("decode_steps")
def decode_steps(args, model_dir):
    """Pure decode steps at batch 64 and 256 near 640 tokens of context: wall time per step against the
    step's floor, and where the GPU time goes (20 profiled steps, kernel intervals)."""
    from llmserve_proto import SamplingParams
    bw, peak = rates()
    out = {}
    for batch in P["step_batches"]:
        engine = make_engine(model_dir, max_num_seqs=batch)
        for i in range(batch):
            engine.add_request(f"r{i}", [P["vocab"][0] + i + j for j in range(P["step_prompt"])],
                               SamplingParams(max_tokens=256, ignore_eos=True))
        while engine.stats()["waiting"] or any(r.is_prefilling for r in engine.scheduler.running):
            engine.step()
        contexts = lambda: [r.num_tokens for r in engine.scheduler.running]  # noqa: E731
        while sum(contexts()) / batch < P["step_context"]:
            engine.step()
        steps, floors, times = P["steps"], [], []
        jit0 = engine.stats()["jit_compilations"]
        for _ in range(steps):
            floors.append(decode_floor(P["config"], contexts(), bw, peak).ms)
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        kernels, _ = profile_calls(engine.step, steps)
        span = span_us(kernels)
        busy = busy_us(kernels)
        split = {c: busy_us([k for k in kernels if kernel_kind(k[0]) == c]) / span if span else 0.0 for c in KINDS}
        ms = sorted(times)[steps // 2] * 1e3
        floor = sum(floors) / steps
        out[f"b{batch}"] = {"mean_context": sum(contexts()) / batch, "ms_per_step": ms, "floor_ms": floor,
                            "fraction_of_floor": floor / ms, "idle_fraction": 1 - busy / span if span else 0.0,
                            "jit_compilations": engine.stats()["jit_compilations"] - jit0,
                            **{f"{c}_fraction": v for c, v in split.items()}}
        engine = None      # frees the pool before the next batch (a closure above reads the name)
        free_device_memory()
    return out


@section("inprocess_closed_loop")
def inprocess_closed_loop(args, model_dir):
    """The IPC closed loop's workload driven in-process, to price the process split (same engine flags)."""
    import random
    from llmserve_proto import SamplingParams
    engine = make_engine(model_dir)
    out = {}
    rnd = random.Random(0)
    params = SamplingParams(max_tokens=P["output"], ignore_eos=True)
    for conc in args.inprocess_concurrency:
        n = 0
        def add():
            nonlocal n
            engine.add_request(f"c{conc}-{n}", [rnd.randrange(*P["vocab"]) for _ in range(P["prompt"])], params)
            n += 1
        for _ in range(conc):
            add()
        warm, secs = P["windows"][0 if args.quick else 1]
        jit0 = engine.stats()["jit_compilations"]
        t0 = time.perf_counter()
        tokens = 0
        while True:
            outs = engine.step()
            now = time.perf_counter() - t0
            if now > warm + secs:
                break
            for o in outs:
                if now > warm:
                    tokens += len(o.new_token_ids)
                if o.finish_reason is not None:
                    add()
        for rid in list(engine.requests):
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        out[f"c{conc}"] = {"output_throughput": tokens / secs,
                           "jit_compilations": engine.stats()["jit_compilations"] - jit0}
    engine = None
    free_device_memory()
    return out


def start_core(model_dir, endpoint, extra, load_format="dummy"):
    cmd = [sys.executable, "-m", "llmserve_core", "--model", model_dir, "--load-format", load_format,
           "--listen", endpoint, "--log-interval", "0", "--log-level", "WARNING"] + extra
    # A benchmark killed mid-run (a device call's timeout) must not leave its core holding the GPU.
    return subprocess.Popen(cmd, preexec_fn=die_with_parent)


def stop_core(proc):
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(endpoint, argv, out_json):
    cmd = [sys.executable, "-m", "llmserve_bench"] + argv + ["--endpoint", endpoint, "--result-json", out_json]
    # A core on a fresh machine compiles its kernels before it answers: give its start-up time.
    cmd += ["--connect-timeout", "600"]
    subprocess.run(cmd, check=True, timeout=1000)
    with open(out_json) as f:
        d = json.load(f)
    # Closed loops report the steady-state window beside the whole run; finite runs have only the latter.
    out = dict(d.get("steady_state") or d["summary"])
    # Kernels the core compiled over the whole run, warm-up window included: the warm-up at start-up
    # should leave none to compile here.
    out["jit_compilations"] = d["summary"].get("core_jit_compilations")
    return out


KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "completed", "window_requests", "core_mean_batch_size", "jit_compilations")


def pick(summary):
    return {k: summary.get(k) for k in KEYS if k in summary}


@section("closed_loop_ipc")
def closed_loop(args, model_dir, tmp):
    endpoint = f"ipc://{tmp}/core.sock"
    core = start_core(model_dir, endpoint, ["--max-model-len", str(P["loop_len"]), "--max-num-seqs",
                                            str(P["loop_seqs"])] + P["core"] + shlex.split(args.core_args))
    out = {}
    try:
        for conc in args.concurrency:
            warm, secs = P["windows"][0 if args.quick else 1]
            out[f"c{conc}"] = pick(bench(endpoint, ["closed-loop", "--max-concurrency", str(conc),
                                                    "--input-len", str(P["prompt"]), "--output-len", str(P["output"]),
                                                    "--warmup-seconds", str(warm), "--measurement-seconds", str(secs),
                                                    "--prompt-mode", "random"],
                                         os.path.join(args.out, f"closed_loop_c{conc}.json")))
    finally:
        stop_core(core)
    return out


@section("chunked_prefill_mix")
def chunked_mix(args, model_dir, tmp):
    out = {}
    for chunked in (True, False):
        endpoint = f"ipc://{tmp}/core-chunk{int(chunked)}.sock"
        warm, secs = P["mix_windows"][0 if args.quick else 1]
        flags = ["--max-model-len", str(P["mix_len"]), "--max-num-seqs", str(P["mix_seqs"])] + P["core"] + [
            "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", str(P["mix_budget"] if chunked else P["mix_len"])]
        core = start_core(model_dir, endpoint, flags)
        try:
            out["chunked" if chunked else "whole_prompt"] = pick(bench(
                endpoint, ["closed-loop", "--max-concurrency", "32", "--mix", P["mix"],
                           "--warmup-seconds", str(warm), "--measurement-seconds", str(secs),
                           "--prompt-mode", "random"],
                os.path.join(args.out, f"mix_chunked{int(chunked)}.json")))
        finally:
            stop_core(core)
    c, w = out.get("chunked", {}), out.get("whole_prompt", {})
    if c.get("p99_itl_ms") and w.get("p99_itl_ms"):
        out["p99_itl_ratio_whole_over_chunked"] = w["p99_itl_ms"] / c["p99_itl_ms"]
    return out


@section("transformers_peer")
def transformers_peer(args, model_dir):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(**{k: v for k, v in P["config"].items() if k not in ("architectures", "model_type")})
    torch.set_default_dtype(P["dtype"])
    with torch.device(P["device"]):
        model = Qwen3ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    sync = torch.cuda.synchronize if P["device"] == "cuda" else (lambda: None)
    out = {}
    g = torch.Generator().manual_seed(0)
    for batch, new in P["peer"]:
        ids = torch.randint(*P["vocab"], (batch, P["peer_prompt"]), generator=g).to(P["device"])
        gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)   # warm up
            sync()
            t0 = time.perf_counter()
            model.generate(ids, **gen)
            sync()
            sec = time.perf_counter() - t0
        out[f"generate_b{batch}"] = {"output_throughput": batch * new / sec, "seconds": sec, "new_tokens": new}
    try:
        batch, new = P["peer"][-1]
        if args.smoke:
            raise RuntimeError("not run in a smoke run (a minute on the CPU)")
        ids = torch.randint(*P["vocab"], (batch, P["peer_prompt"]), generator=g).tolist()
        gc_ = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        with torch.no_grad():
            t0 = time.perf_counter()
            res = model.generate_batch(inputs=ids, generation_config=gc_)
            sync()
            sec = time.perf_counter() - t0
        toks = sum(len(r.generated_tokens) for r in res.values())
        out[f"generate_batch_c{batch}"] = {"output_throughput": toks / sec, "seconds": sec, "tokens": toks}
    except Exception as e:
        out[f"generate_batch_c{batch}"] = {"error": f"{type(e).__name__}: {e}"}
    del model
    free_device_memory()
    return out


def jit_growth() -> dict:
    """Kernels compiled inside each timed run (None where the core did not report the count)."""
    out = {}
    for name in ("batch1_decode", "decode_steps", "inprocess_closed_loop", "closed_loop_ipc", "chunked_prefill_mix"):
        for k, v in RESULTS.get(name, {}).items():
            if isinstance(v, dict) and "jit_compilations" in v:
                out[f"{name}.{k}"] = v["jit_compilations"]
    return out


def summarize():
    rows = []
    bw = RESULTS.get("copy_bandwidth", {})
    rows.append(("copy bandwidth", f"{bw.get('tb_per_s', float('nan')):.2f} TB/s"))
    for k, v in RESULTS.get("batch1_decode", {}).items():
        if isinstance(v, dict):
            rows.append((f"batch-1 decode {k}", f"{v['ms_per_token']:.2f} ms/token, floor {v['floor_ms']:.2f} ms "
                                                f"({100 * v['fraction_of_floor']:.0f}% of floor)"))
    peak = RESULTS.get("bf16_peak", {})
    rows.append(("bf16 matmul peak", f"{peak.get('tflop_per_s', float('nan')):.0f} TFLOP/s"))
    for k, v in RESULTS.get("decode_steps", {}).items():
        if isinstance(v, dict):
            rows.append((f"decode step {k}, context {v['mean_context']:.0f}",
                         f"{v['ms_per_step']:.2f} ms, floor {v['floor_ms']:.2f} ms ({100 * v['fraction_of_floor']:.0f}%); "
                         f"GEMM {100 * v['gemm_fraction']:.0f}%, attention {100 * v['attention_fraction']:.0f}%, "
                         f"other {100 * v['other_fraction']:.0f}%, idle {100 * v['idle_fraction']:.1f}%"))
    cl = RESULTS.get("closed_loop_ipc", {})
    peer = RESULTS.get("transformers_peer", {})
    for k, v in cl.items():
        if isinstance(v, dict) and v.get("output_throughput"):
            rows.append((f"closed-loop IPC {k}", f"{v['output_throughput']:.0f} tok/s, TTFT p99 {v.get('p99_ttft_ms', 0):.0f} ms, "
                                                 f"TPOT median {v.get('median_tpot_ms', 0):.1f} ms"))
    inproc = RESULTS.get("inprocess_closed_loop", {})
    for k, v in inproc.items():
        ipc = cl.get(k, {}).get("output_throughput") if isinstance(cl.get(k), dict) else None
        if isinstance(v, dict) and ipc:
            RESULTS.setdefault("ipc_over_inprocess", {})[k] = ipc / v["output_throughput"]
            rows.append((f"in-process {k}", f"{v['output_throughput']:.0f} tok/s; IPC / in-process = "
                                            f"{ipc / v['output_throughput']:.3f}"))
    for k, v in peer.items():
        if isinstance(v, dict) and v.get("output_throughput"):
            rows.append((f"transformers {k}", f"{v['output_throughput']:.0f} tok/s"))
    ours64 = cl.get("c64", {}).get("output_throughput") if isinstance(cl.get("c64"), dict) else None
    hf64 = peer.get("generate_b64", {}).get("output_throughput") if isinstance(peer.get("generate_b64"), dict) else None
    if ours64 and hf64:
        RESULTS["ratio_c64_vs_transformers_generate"] = ours64 / hf64
        rows.append(("c64 ours / transformers generate", f"{ours64 / hf64:.1f}x"))
    mix = RESULTS.get("chunked_prefill_mix", {})
    for k in ("chunked", "whole_prompt"):
        if isinstance(mix.get(k), dict):
            rows.append((f"mix ITL p99 {k}", f"{mix[k].get('p99_itl_ms', float('nan')):.1f} ms"))
    growth = jit_growth()
    RESULTS["jit_compilations_in_timed_runs"] = growth
    grown = {k: v for k, v in growth.items() if v}
    rows.append(("kernels compiled inside timed runs", "none" if not grown else f"FAIL: {grown}"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"| {a.ljust(width)} | {b} |" for a, b in rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="closed loops over IPC (default 1 8 64 256)")
    ap.add_argument("--inprocess-concurrency", type=int, nargs="+", default=None, help="in-process loops (default 64)")
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, metavar="SECTION",
                    help=f"sections not to run: {' '.join(SECTIONS)}")
    ap.add_argument("--core-args", default="",
                    help="more flags for the closed loops' core, e.g. '--quantization fp8 --kv-cache-dtype fp8_e4m3'")
    ap.add_argument("--smoke", action="store_true",
                    help="every section on the tiny shape, on the CPU, in seconds (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        P.update(SMOKE, config=dict(QWEN3_8B_CONFIG, **smoke_shape()))
    args.concurrency = args.concurrency or ([2] if args.smoke else [1, 8, 64, 256])
    args.inprocess_concurrency = args.inprocess_concurrency or ([2] if args.smoke else [64])
    RESULTS["core_args"] = args.core_args
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="llmserve-bench-")
    model_dir = write_qwen3_8b_dir(os.path.join(tmp, "qwen3-8b-dummy"), **(smoke_shape() if args.smoke else {}))
    RESULTS["device"] = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    try:
        RESULTS["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    copy_bandwidth(args)
    bf16_peak(args)
    batch1_decode(args, model_dir)
    decode_steps(args, model_dir)
    inprocess_closed_loop(args, model_dir)
    closed_loop(args, model_dir, tmp)
    chunked_mix(args, model_dir, tmp)
    transformers_peer(args, model_dir)
    table = summarize()
    with open(os.path.join(args.out, "h200_e2e.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    with open(os.path.join(args.out, "h200_e2e.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    # Nothing may compile after start-up: a timed run that compiled a kernel fails the benchmark.
    if any(RESULTS["jit_compilations_in_timed_runs"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
