"""`make demo`: the main job end to end on the CPU.

Starts llmserve-core as a separate process on the embedded tiny model: the Qwen3 and EAGLE-3 pair shipped
in llmserve_core/data/trained_pair (trained on the repo's corpus by scripts/train_eagle_pair.py, so the
text reads like Python docstrings), with speculative decoding on. Streams a chat completion through the
client library to the terminal, prints the engine's stats with the draft acceptance, runs a short
closed-loop benchmark over IPC and prints its table, then stops the core with SIGTERM and checks that it
exited cleanly.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

from llmserve_client import Client


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    pair = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "llmserve_core", "data",
                        "trained_pair")
    ap.add_argument("--model", default=os.path.join(pair, "target"))
    ap.add_argument("--speculative-model", default=os.path.join(pair, "draft"),
                    help="EAGLE-3 draft ('' to serve without speculation)")
    ap.add_argument("--prompt", default="What does the parser return?")
    ap.add_argument("--bench-seconds", type=float, default=6.0)
    args = ap.parse_args()

    runtime = tempfile.mkdtemp(prefix="llmserve-demo-")
    os.chmod(runtime, 0o700)
    endpoint = f"ipc://{runtime}/core.sock"
    cmd = [sys.executable, "-m", "llmserve_core", "--model", args.model, "--listen", endpoint,
           "--device", "cpu", "--log-interval", "0", "--log-level", "WARNING"]
    if args.speculative_model:
        cmd += ["--speculative-model", args.speculative_model]
    print("$", " ".join(cmd[2:]), flush=True)
    core = subprocess.Popen(cmd)
    try:
        with Client(endpoint, connect_timeout=120) as client:
            info = client.model_info
            print(f"connected: {info.model} (vocab {info.vocab_size}, max_model_len {info.max_model_len})\n")
            messages = [{"role": "user", "content": args.prompt}]
            print(f"user> {args.prompt}\nassistant> ", end="", flush=True)
            stream = client.stream(messages, max_tokens=64, temperature=0.0)  # greedy: speculation gives the plain tokens
            for chunk in stream:
                print(chunk.text, end="", flush=True)
            done = stream.completion
            print(f"\n\n[{done.finish_reason}] {done.usage.completion_tokens} tokens, "
                  f"TTFT {1000 * done.timings.ttft:.1f} ms, total {1000 * done.timings.e2e:.1f} ms")
            stats = client.stats()
            keep = ("running", "waiting", "used_kv_blocks", "cached_kv_blocks", "total_kv_blocks", "prefix_hit_rate", "num_steps",
                    "spec_acceptance_rate", "spec_mean_acceptance_length")
            print("engine stats:", {k: round(v, 3) if isinstance(v, float) else v
                                    for k, v in stats.items() if k in keep})
        run_bench(endpoint, args.bench_seconds)
    finally:
        core.send_signal(signal.SIGTERM)
        try:
            rc = core.wait(timeout=60)
        except subprocess.TimeoutExpired:
            core.kill()
            rc = core.wait()
    print(f"\nllmserve-core exited with status {rc} after SIGTERM")
    return 0 if rc == 0 else 1


def run_bench(endpoint: str, seconds: float) -> None:
    from llmserve_bench import run_closed_loop
    print(f"\nclosed-loop benchmark over IPC ({seconds:.0f} s window, concurrency 8, 64 in / 32 out):")
    summary = run_closed_loop(endpoint, max_concurrency=8, input_len=64, output_len=32,
                              warmup_seconds=3.0, measurement_seconds=seconds)
    print(summary.table())


if __name__ == "__main__":
    sys.exit(main())
