"""What the process split costs: one closed-loop workload run in-process (Engine) and over IPC
(llmserve-core subprocess + AsyncClient), reported as a ratio of wall times.

Closed loop: `concurrency` requests are always in flight; each finished one is replaced by the next until
`num_requests` have run. Same prompts (seeded random token ids), greedy, fixed output length (ignore_eos),
same EngineConfig on both sides. Every run is preceded by an unmeasured warm-up; each configuration is
repeated and the median is kept.

    python benchmarks/ipc_overhead.py [--model DIR] [--out benchmarks/results]

Without --model a tiny random Qwen3 is made in a temporary directory (CPU). On the tiny model an engine
step takes about a millisecond, so this is close to the worst case for the split: per-step messaging is
not hidden behind model compute as it is with a real model on a GPU.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmserve_client import AsyncClient, Client  # noqa: E402
from llmserve_client.child_process import die_with_parent  # noqa: E402
from llmserve_client import run as run_async  # noqa: E402


def make_prompts(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU time of another process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_in_process(engine, prompts, concurrency: int, max_tokens: int) -> dict:
    from llmserve_proto import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = collections.deque(enumerate(prompts))
    started: dict[str, float] = {}
    latencies, tokens = [], 0

    def add():
        i, p = pending.popleft()
        rid = f"r{i}"
        started[rid] = time.perf_counter()
        engine.add_request(rid, p, params)

    t0, cpu0 = time.perf_counter(), time.process_time()
    while pending and len(started) < concurrency:
        add()
    while started:
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                latencies.append(time.perf_counter() - started.pop(out.request_id))
                if pending:
                    add()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "cpu_s": time.process_time() - cpu0, "output_tokens": tokens,
            "mean_latency_s": statistics.mean(latencies)}


async def run_over_ipc(client: AsyncClient, prompts, concurrency: int, max_tokens: int, detokenize: bool,
                       core_pid: int) -> dict:
    queue = collections.deque(prompts)
    latencies, tokens = [], 0

    async def user():
        nonlocal tokens
        while queue:
            p = queue.popleft()
            t = time.perf_counter()
            comp = await client.generate(p, detokenize=detokenize, max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True)
            latencies.append(time.perf_counter() - t)
            tokens += len(comp.token_ids)

    t0, cpu0, core0 = time.perf_counter(), time.process_time(), process_cpu_seconds(core_pid)
    await asyncio.gather(*[user() for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0 + process_cpu_seconds(core_pid) - core0
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": tokens, "mean_latency_s": statistics.mean(latencies)}


def median_of(runs: list[dict]) -> dict:
    mid = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return {**mid, "wall_s_all": [round(r["wall_s"], 4) for r in runs]}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: a fresh tiny random Qwen3)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads on both sides (1: steadier on a small shared CPU)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()

    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="ipc-overhead-")
    model = args.model
    if model is None:
        from llmserve_core.models.tiny import make_tiny_model
        model = make_tiny_model(os.path.join(tmp, "tiny"), seed=0)
    engine_args = dict(device=args.device, max_model_len=args.prompt_len + args.max_tokens + 16, num_kv_blocks=1024)

    # Both sides live at once and runs alternate (in-process, IPC, IPC + detokenize) so drift in machine load
    # hits all three alike; an idle side costs nothing (the core's threads sleep in poll).
    import torch
    torch.set_num_threads(args.torch_threads)
    from llmserve_core import Engine, EngineConfig
    endpoint = f"ipc://{tmp}/core.sock"
    flags = ["--device", args.device, "--max-model-len", str(engine_args["max_model_len"]),
             "--num-kv-blocks", str(engine_args["num_kv_blocks"]), "--log-interval", "0"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(args.torch_threads)}
    core = subprocess.Popen([sys.executable, "-m", "llmserve_core", "--model", model, "--listen", endpoint, *flags],
                            env=env, stderr=open(os.path.join(tmp, "core.log"), "wb"), preexec_fn=die_with_parent)
    engine = Engine(EngineConfig(model=model, **engine_args))
    vocab = engine.model_info.vocab_size
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab, seed=1)
    warm = make_prompts(8, args.prompt_len, vocab, seed=2)
    runs = {k: collections.defaultdict(list) for k in ("in_process", "ipc", "ipc_detokenize")}
    try:
        Client(endpoint, connect_timeout=120).close()

        async def measure():
            async with AsyncClient(endpoint) as client:
                await client.get_tokenizer()
                for c in args.concurrency:
                    run_in_process(engine, warm, min(c, len(warm)), args.max_tokens)
                    await run_over_ipc(client, warm, min(c, len(warm)), args.max_tokens, True, core.pid)
                    for _ in range(args.reps):
                        runs["in_process"][c].append(run_in_process(engine, prompts, c, args.max_tokens))
                        runs["ipc"][c].append(await run_over_ipc(client, prompts, c, args.max_tokens, False, core.pid))
                        runs["ipc_detokenize"][c].append(await run_over_ipc(client, prompts, c, args.max_tokens, True, core.pid))
                    print(f"c={c:<3} " + "  ".join(f"{k} {statistics.median(r['wall_s'] for r in v[c]):.3f} s"
                                                  for k, v in runs.items()), flush=True)

        run_async(measure())
    finally:
        core.send_signal(signal.SIGTERM)
        core.wait(30)
    results = {k: {c: median_of(rs) for c, rs in v.items()} for k, v in runs.items()}
    torch_threads = torch.get_num_threads()

    rows = []
    for c in args.concurrency:
        ip, ipc, ipcd = results["in_process"][c], results["ipc"][c], results["ipc_detokenize"][c]
        rows.append({
            "concurrency": c,
            "in_process_tok_s": round(ip["output_tokens"] / ip["wall_s"], 1),
            "ipc_tok_s": round(ipc["output_tokens"] / ipc["wall_s"], 1),
            "ipc_detokenize_tok_s": round(ipcd["output_tokens"] / ipcd["wall_s"], 1),
            "ipc_over_in_process_wall": round(ipc["wall_s"] / ip["wall_s"], 3),
            "ipc_detokenize_over_in_process_wall": round(ipcd["wall_s"] / ip["wall_s"], 3),
            "ipc_over_in_process_cpu": round(ipc["cpu_s"] / ip["cpu_s"], 3),
            "ipc_detokenize_over_in_process_cpu": round(ipcd["cpu_s"] / ip["cpu_s"], 3),
            "ipc_extra_cpu_us_per_token": round(1e6 * (ipc["cpu_s"] - ip["cpu_s"]) / ipc["output_tokens"], 1),
            "in_process_mean_latency_ms": round(1000 * ip["mean_latency_s"], 2),
            "ipc_mean_latency_ms": round(1000 * ipc["mean_latency_s"], 2),
        })
    report = {
        "benchmark": "ipc_overhead",
        "git_commit": git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": "tiny random Qwen3 (make_tiny_model seed 0)" if args.model is None else args.model,
        "device": args.device,
        "cpu_count": os.cpu_count(),
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "torch_threads": torch_threads,
        "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "greedy": True, "ignore_eos": True, "reps": args.reps, "statistic": "median wall time",
                     "order": "in-process, IPC, IPC+detokenize alternating per rep"},
        "rows": rows,
        "raw": {k: {str(c): v for c, v in d.items()} for k, d in results.items()},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ipc_overhead.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(args.out, "ipc_overhead.md"), "w") as f:
        f.write(render_md(report))
    print(render_md(report))
    return 0


def render_md(r: dict) -> str:
    w = r["workload"]
    lines = [
        "# IPC overhead: in-process Engine vs llmserve-core + client",
        "",
        f"Commit `{r['git_commit']}`, {r['date_utc']}, {r['model']} on {r['device']} "
        f"({r['cpu_count']} CPUs, torch threads {r['torch_threads']}; 1-minute load average "
        f"{r['load_average_1min']['before']} before, {r['load_average_1min']['after']} after).",
        f"Closed loop, {w['num_requests']} requests of {w['prompt_len']} prompt + {w['max_tokens']} output tokens "
        f"(greedy, ignore_eos); median of {w['reps']} alternating runs after a warm-up. Produced by `python benchmarks/ipc_overhead.py`.",
        "",
        "| concurrency | in-process tok/s | IPC tok/s | IPC + detokenize tok/s | IPC / in-process wall | "
        "(with detokenize) | IPC / in-process CPU time | (with detokenize) | extra CPU µs per token (IPC) | "
        "mean latency in-process ms | mean latency IPC ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['concurrency']} | {row['in_process_tok_s']} | {row['ipc_tok_s']} | "
                     f"{row['ipc_detokenize_tok_s']} | {row['ipc_over_in_process_wall']} | "
                     f"{row['ipc_detokenize_over_in_process_wall']} | {row['ipc_over_in_process_cpu']} | "
                     f"{row['ipc_detokenize_over_in_process_cpu']} | {row['ipc_extra_cpu_us_per_token']} | "
                     f"{row['in_process_mean_latency_ms']} | "
                     f"{row['ipc_mean_latency_ms']} |")
    lines += ["", "A ratio of 1.0 means the process split costs nothing; above 1, IPC is slower by that factor. "
              "CPU time sums both processes (core + client) for IPC; it is the fairer measure when other work "
              "shares the machine: under contention two runnable processes get a larger share of the CPUs than "
              "one, which can make the IPC wall time look better than in-process. "
              "The tiny model's steps take about a millisecond on CPU, so fixed per-step costs (a message per "
              "client per step, the client's decode and wake-up, both processes sharing the same few cores) "
              "show here far more than they would behind a real model's step on a GPU.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:       # rewrite the .md from a saved .json
        print(render_md(json.load(open(sys.argv[2]))), end="")
        sys.exit(0)
    sys.exit(main())
