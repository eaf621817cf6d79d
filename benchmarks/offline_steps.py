"""Where an offline batch's time goes: the peer comparison's 256 x (512 in, 256 out) run (benchmarks/
peer_compare.py's workload, Qwen3-8B shape, dummy weights), each Engine.step() timed and sorted into
steps that still prefill (some request waiting or mid-prompt before the step) and pure decode steps, with
sampling at temperature 1 (the peer run's) and greedy, and with the default and a doubled token budget.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/offline_steps.py --out $OUT/offline_steps.json   # H200, ~2 min
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qwen3_8b import write_qwen3_8b_dir  # noqa: E402


def timed_run(engine, prompts, params) -> dict:
    """engine.generate with every step timed and classified."""
    steps = []
    real_step = engine.step

    def step():
        sched = engine.scheduler
        prefilling = bool(sched.waiting) or any(r.is_prefilling for r in sched.running)
        t0 = time.perf_counter()
        out = real_step()
        steps.append((prefilling, len(sched.running), (time.perf_counter() - t0) * 1e3))
        return out
    engine.step = step
    try:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        del engine.step
    tokens = sum(len(o.token_ids) for o in outs)
    pre = [ms for p, _, ms in steps if p]
    dec = [(n, ms) for p, n, ms in steps if not p]
    by_batch = {}
    for n, ms in dec:
        by_batch.setdefault(min(256, 1 << (max(n, 1) - 1).bit_length()), []).append(ms)
    return {"wall_s": wall, "tok_per_s": tokens / wall, "steps": len(steps),
            "prefill_steps": len(pre), "prefill_ms": sum(pre),
            "decode_steps": len(dec), "decode_ms": sum(ms for _, ms in dec),
            "decode_step_ms_by_batch": {b: {"steps": len(v), "median_ms": statistics.median(v)}
                                        for b, v in sorted(by_batch.items())}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--budgets", default="8192,16384", help="max_num_batched_tokens values to run")
    args = ap.parse_args()
    from llmserve_core import Engine, EngineConfig
    from llmserve_proto import SamplingParams
    model_dir = write_qwen3_8b_dir(tempfile.mkdtemp())
    rnd = random.Random(0)
    prompts = [[rnd.randrange(1000, 150000) for _ in range(512)] for _ in range(args.prompts)]
    res = {"prompts": args.prompts, "runs": {}}
    for budget in map(int, args.budgets.split(",")):
        engine = Engine(EngineConfig(model=model_dir, load_format="dummy", max_model_len=4096, max_num_seqs=256,
                                     gpu_memory_utilization=0.85, max_num_batched_tokens=budget))
        engine.generate(prompts[:16], SamplingParams(max_tokens=8, ignore_eos=True))
        for temp in ((1.0, 0.0) if budget == 8192 else (1.0,)):
            # Fresh prompts per run (the prefix cache would serve repeated ones).
            run_prompts = [[(t + 7919 * (int(temp) + budget)) % 150000 for t in p] for p in prompts]
            r = timed_run(engine, run_prompts, SamplingParams(temperature=temp, max_tokens=256, ignore_eos=True))
            key = f"budget{budget}_t{temp:g}"
            res["runs"][key] = r
            print(f"{key}: {r['tok_per_s']:.0f} tok/s, {r['wall_s']:.2f} s; prefill steps {r['prefill_steps']} "
                  f"{r['prefill_ms'] / 1e3:.2f} s, decode steps {r['decode_steps']} {r['decode_ms'] / 1e3:.2f} s; "
                  f"decode step by batch {json.dumps({b: round(v['median_ms'], 2) for b, v in r['decode_step_ms_by_batch'].items()})}",
                  flush=True)
        engine.close()
        del engine
        gc.collect()          # the engine's graphs hold reference cycles: free its pool before the next one
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:     # after each budget: a run cut short keeps what it measured
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
