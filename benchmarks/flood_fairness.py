"""Fair shares under a flood, in one run: `llmserve-bench flood` on the Qwen3-8B shape with dummy weights.

    python benchmarks/flood_fairness.py --out DIR           # one GPU: about 3 minutes, start-up included
    python benchmarks/flood_fairness.py --out DIR --smoke   # the CPU and the tiny test model: under a minute

One client keeps 1024 requests of 512 prompt / 400 output tokens in flight while a second client sends one
request of 32 / 8 tokens a second; the second client's TTFT p50/p99 is set beside the same probes on an idle
engine, and the flood's output throughput beside the flood alone. The issue's flood is 10,000 requests; 1024
keep the engine just as saturated (256 run, 768 wait, refilled as they end), and the 9,000 more would only
lengthen a queue that a waiting client's admission does not walk: they fit neither the queue cap nor 3
minutes. Three phases of --phase-seconds (default 30). Writes DIR/flood_fairness.json (commit, card, phases)
and prints the table. Extra flags after `--` go to llmserve-core (e.g. --fairness-preempt-steps 0 for the
scheduler without fairness preemption).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from qwen3_8b import write_qwen3_8b_dir  # noqa: E402

GPU_CORE_ARGS = ["--load-format", "dummy", "--max-model-len", "4096", "--max-num-seqs", "256", "--log-interval", "0"]
SMOKE_CORE_ARGS = ["--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "8", "--num-kv-blocks", "512",
                   "--fairness-preempt-steps", "4", "--log-interval", "0"]


def card() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "cpu"
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    core_extra = []
    if "--" in argv:
        argv, core_extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for flood_fairness.json")
    p.add_argument("--smoke", action="store_true", help="the tiny test model on the CPU, seconds-long phases")
    p.add_argument("--phase-seconds", type=float, help="seconds per phase (default: 30; 3 with --smoke)")
    p.add_argument("--flood-concurrency", type=int, help="flood requests in flight (default: 1024; 24 with --smoke)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from llmserve_bench.cli import main as bench
    with tempfile.TemporaryDirectory(prefix="flood-fairness-") as tmp:
        if args.smoke:
            from llmserve_core.models.tiny import make_tiny_model
            model, core_args = make_tiny_model(os.path.join(tmp, "tiny"), seed=0), SMOKE_CORE_ARGS
            shape = ["--input-len", "16", "--output-len", "48", "--probe-input-len", "8", "--probe-output-len", "2",
                     "--probe-rate", "4"]
            phase, concurrency = args.phase_seconds or 3.0, args.flood_concurrency or 24
        else:
            model, core_args = write_qwen3_8b_dir(os.path.join(tmp, "qwen3-8b")), GPU_CORE_ARGS
            shape = ["--input-len", "512", "--output-len", "400", "--probe-input-len", "32", "--probe-output-len", "8",
                     "--probe-rate", "1"]
            phase, concurrency = args.phase_seconds or 30.0, args.flood_concurrency or 1024
        path = os.path.join(args.out, "flood_fairness.json")
        rc = bench(["flood", "--model", model, "--connect-timeout", "900", "--flood-concurrency", str(concurrency),
                    "--phase-seconds", str(phase), "--result-json", path, *shape, "--", *core_args, *core_extra])
    if rc != 0:
        return rc
    with open(path) as f:
        result = json.load(f)
    result["card"] = card()
    result["smoke"] = args.smoke
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"card: {result['card']}, commit: {result['environment'].get('git_commit')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
