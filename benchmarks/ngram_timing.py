"""Prompt-lookup (ngram) speculative step timing at the Qwen3-8B shape: a whole drafting step against a plain
decode step, per batch size and number of proposed tokens.

Dummy weights (timing does not depend on weight values). Every request holds a repeating run of tokens at
context ~--context, so each one finds a match and proposes all k drafts: the verify cost measured is the
full-length one. Per batch size and k:

  t_decode   a plain decode step through the model runner (its CUDA graph) with sampling and the readback
  t_step     a whole drafting step through SpecExecutor.execute: the proposals (host), the verify forward of
             1 + k rows per request (the verify graph), greedy verification and the readback
  t_propose  the host part alone: which requests draft and their k drafts (median wall time, ms)

and step / decode, the acceptance length that breaks even (the same number), and the implied speedup
AL * t_decode / t_step at acceptance lengths 1.5, 2, 3 and 4 (benchmarks/ngram_cpu.py measures what a
copy-heavy workload accepts). One engine holds the weights; each k gets its own executor and verify graph.

    python benchmarks/ngram_timing.py --out $OUT/ngram_timing                    # on the GPU, ~3 minutes
    python benchmarks/ngram_timing.py --smoke --out /tmp/ngram_smoke             # tiny shapes on the CPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from llmserve_core import Engine, EngineConfig  # noqa: E402
from llmserve_core.engine.request import Request  # noqa: E402
from llmserve_core.engine.scheduler import ScheduledBatch  # noqa: E402
from llmserve_core.engine.spec.executor import SpecExecutor  # noqa: E402
from llmserve_core.engine.spec.ngram import NgramProposer  # noqa: E402
from llmserve_proto import SamplingParams  # noqa: E402
from ngram_cpu import host_cost  # noqa: E402
from spec_timing import timer  # noqa: E402

ACCEPTANCE_LENGTHS = (1.5, 2.0, 3.0, 4.0)
GREEDY = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
PERIOD = 97                  # tokens in each request's repeating run


def repeating_requests(engine: Engine, batch: int, context: int, vocab: int) -> list[Request]:
    """`batch` requests of `context` tokens repeating a run of PERIOD, about to decode their last token,
    with blocks for the deepest drafts."""
    rnd = random.Random(batch)
    reqs = []
    for i in range(batch):
        run = [rnd.randrange(3, vocab) for _ in range(PERIOD)]
        req = Request(f"r{i}", (run * (context // PERIOD + 1))[:context], GREEDY, frozenset(), engine.max_model_len)
        engine.block_manager.allocate(req, context + engine.lookahead + 1)
        req.num_computed_tokens = context - 1
        req.speculative = True
        reqs.append(req)
    return reqs


def executors(engine: Engine, depths: list[int]) -> dict[int, SpecExecutor]:
    """An executor (and its verify graph) per depth over the engine's runner; the engine's own serves the
    deepest, whose lookahead the runner and the block tables were sized for."""
    out = {}
    for k in depths:
        if k == engine.spec.gamma:
            out[k] = engine.spec
        else:
            cfg = dataclasses.replace(engine.config, speculative_gamma=k)
            out[k] = SpecExecutor(cfg, engine.runner, NgramProposer(cfg), engine.max_model_len)
    return out


@torch.inference_mode()
def time_batch(engine: Engine, execs: dict[int, SpecExecutor], batch: int, args, measure) -> list[dict]:
    reqs = repeating_requests(engine, batch, args.context, engine.model_info.vocab_size)
    try:
        sched = ScheduledBatch(reqs, [1] * batch)
        t_decode = measure(lambda: engine.runner.launch(sched).results())
        rows = []
        for k, ex in execs.items():
            while any(r.spec_state is None or r.spec_state.length < r.num_tokens for r in reqs):
                ex.on_scheduled(sched, engine.block_manager)      # index every request's tokens (untimed)
            proposal = ex.proposer.propose(sched, ex.proposer.drafting(sched), k)
            matched = sum(n == k for n in proposal.lengths) / batch
            host = []

            def propose():
                t0 = time.perf_counter()
                ex.proposer.propose(sched, ex.proposer.drafting(sched), k)
                host.append(time.perf_counter() - t0)
            for _ in range(args.iters):
                propose()
            row = {"batch": batch, "k": k, "t_decode": t_decode, "t_step": measure(lambda: ex.execute(sched)),
                   "t_propose": 1000 * statistics.median(host), "full_length_share": matched,
                   "verify_graph": "verify" in ex.graphs and ex.graphs["verify"].bucket_for(batch) is not None}
            row["step_over_decode"] = row["t_step"] / t_decode
            for al in ACCEPTANCE_LENGTHS:
                row[f"speedup_al{al}"] = al * t_decode / row["t_step"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows
    finally:
        for r in reqs:
            engine.block_manager.release(r)


def markdown(result: dict) -> str:
    lines = [f"# Prompt-lookup (ngram) step timing: {result['shape']} on {result['device_name']}, commit {result['commit']}",
             "", f"context {result['context']}, {result['dtype']}, attention {result['attention_backend']}, graphs "
             f"{'off' if result['enforce_eager'] else 'on'}; every request proposes all k drafts (a repeating run); "
             "milliseconds (CUDA-event medians; t_propose: host wall time).", "",
             "| batch | k | decode | spec step | step / decode | propose (host) | "
             + " | ".join(f"x @AL {al}" for al in ACCEPTANCE_LENGTHS) + " |",
             "|---" * (6 + len(ACCEPTANCE_LENGTHS)) + "|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['batch']} | - | failed: {row['error']} |")
            continue
        lines.append(f"| {row['batch']} | {row['k']} | {row['t_decode']:.2f} | {row['t_step']:.2f} "
                     f"| {row['step_over_decode']:.2f} | {row['t_propose']:.3f} | "
                     + " | ".join(f"{row[f'speedup_al{al}']:.2f}" for al in ACCEPTANCE_LENGTHS) + " |")
    lines += ["", "step / decode is also the acceptance length (tokens per request per step) at which drafting "
              "breaks even; x @AL: AL * decode / spec step."]
    for h in result.get("host_cost", []):
        lines.append(f"- host work per drafting step, batch {h['batch']} x {h['context']} tokens, k {h['k']}, "
                     f"n-grams {h['lookup'][0]}..{h['lookup'][1]}: {h['step_ms']:.3f} ms median ({h['index_ms']:.3f} "
                     f"index update, {h['propose_ms']:.3f} proposals), p90 {h['step_ms_p90']:.3f} ms; building one "
                     f"request's index {h['build_ms_per_request']:.1f} ms")
    return "\n".join(lines) + "\n"


def build_engine(args, depths: list[int], batches: list[int], tmp: Path, device: torch.device) -> Engine:
    from qwen3_8b import smoke_shape, write_qwen3_8b_dir
    target = write_qwen3_8b_dir(str(tmp / "target"), **(smoke_shape() if args.smoke else {}))
    block_size = 16
    per_seq = -(-(args.context + max(depths) + 2) // block_size)
    return Engine(EngineConfig(
        model=target, device=device.type, load_format="dummy", speculative_method="ngram",
        speculative_gamma=max(depths), prompt_lookup_min=2, prompt_lookup_max=4, speculative_policy="always",
        warmup=False, max_num_seqs=max(batches), max_model_len=args.context + 64, block_size=block_size,
        num_kv_blocks=max(batches) * per_seq + 1, enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend, max_num_batched_tokens=max(8192, max(batches) * (max(depths) + 1))))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for ngram_timing.json and ngram_timing.md")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--depths", default="3,5,8", help="proposed tokens per step (num_speculative_tokens)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--host-context", type=int, default=32768,
                    help="also time the proposer's host work at batch 64 of this many tokens each (0: skip)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, not the GPU")
    ap.add_argument("--commit", default=None, help="the commit to name (default: git rev-parse, where there is a .git)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    depths = sorted(int(k) for k in args.depths.split(","))
    if args.smoke:
        batches = [b for b in batches if b <= 4] or [1]
        args.context, args.warmup, args.iters = min(args.context, 200), 1, 3
        args.host_context = min(args.host_context, 2000)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args, depths, batches, Path(tmp), device)
        execs = executors(engine, depths)
        setup_s = time.perf_counter() - started
        print(f"engine and {len(execs)} verify graphs ready in {setup_s:.0f} s", flush=True)
        measure = timer(device, args.warmup, args.iters)
        rows = []
        for b in batches:
            try:
                rows += time_batch(engine, execs, b, args, measure)
            except Exception as e:        # one failing size (e.g. out of memory) must not lose the others
                traceback.print_exc()
                rows.append({"batch": b, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        # This machine's host CPU: the index update and the proposals of a batch of 64 long requests a step.
        costs = [host_cost(64, args.host_context, k, lo, hi, 100) for k, lo, hi in ((5, 2, 4), (5, 5, 5))
                 ] if args.host_context else []
        result = {"commit": commit, "shape": "tiny (smoke)" if args.smoke else "Qwen3-8B (dummy)",
                  "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "dtype": str(engine.runner.dtype).replace("torch.", ""),
                  "attention_backend": engine.runner.attn_backend.name,
                  "enforce_eager": args.enforce_eager or engine.runner.graphs is None, "context": args.context,
                  "depths": depths, "warmup": args.warmup, "iters": args.iters, "setup_s": setup_s,
                  "total_s": time.perf_counter() - started, "rows": rows, "host_cost": costs}
    (out_dir / "ngram_timing.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out_dir / "ngram_timing.md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
