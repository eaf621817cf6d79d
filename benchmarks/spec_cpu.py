"""Plain vs EAGLE-3 speculative decoding on the shipped trained pair, in-process on the CPU.

Greedy, held-out prompts (every 20th corpus paragraph, which training never saw), fixed output length.
Reports wall time per generated token for requests run one at a time (batch 1) and all together, the
acceptance length, and checks that speculative output equals plain output token for token.

    python benchmarks/spec_cpu.py [--num-prompts 16] [--max-tokens 40] [--out benchmarks/results]

    python benchmarks/spec_cpu.py --modes plain,dynamic-6x4-32   # a subset

The tiny model makes every forward cost about the same fixed Python and launch overhead, whatever its
batch or query length, so this measures the executor's step count and overhead more than arithmetic:
it is the CPU counterpart of the H200 timing in spec_timing.py, not a prediction of it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmserve_core import Engine, EngineConfig  # noqa: E402
from llmserve_proto import SamplingParams  # noqa: E402

PAIR = ROOT / "llmserve_core/data/trained_pair"
MODES = {
    "plain": {},
    "chain-gamma3": dict(speculative_gamma=3),
    "tree-eagle-small": dict(speculative_gamma=3, speculative_tree="eagle-small"),
    # Dynamic trees: --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens.
    "dynamic-5x4-24": dict(speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=24),
    "dynamic-6x4-32": dict(speculative_num_steps=6, speculative_eagle_topk=4, speculative_num_draft_tokens=32),
    "dynamic-8x8-64": dict(speculative_num_steps=8, speculative_eagle_topk=8, speculative_num_draft_tokens=64),
    # The adaptive policy over the 6x4 tree: it drafts only where its measured step costs say it pays.
    "dynamic-6x4-32-adaptive": dict(speculative_num_steps=6, speculative_eagle_topk=4, speculative_num_draft_tokens=32,
                                    speculative_policy="adaptive"),
}


def held_out_prompts(n: int, length: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    from llmserve_core.data import corpus_paragraphs
    tok = Tokenizer.from_file(str(PAIR / "target/tokenizer.json"))
    held = [p for i, p in enumerate(corpus_paragraphs()) if i % 20 == 19]
    return [ids[:length] for ids in (tok.encode(t).ids for t in held) if len(ids) >= length][:n]


def make_engine(mode: str) -> Engine:
    extra = MODES[mode]
    if extra:
        # Pinned to drafting every step unless the mode says otherwise: what each draft shape accepts and costs.
        extra = {"speculative_model": str(PAIR / "draft"), "speculative_policy": "always", **extra}
    # A pool of 1024 blocks (16k tokens) holds every prompt at once; the default 1 GiB per engine would
    # take gigabytes across the modes.
    return Engine(EngineConfig(model=str(PAIR / "target"), device="cpu", dtype="float32",
                               enable_prefix_caching=False, num_kv_blocks=1024, **extra))


def timed(engine: Engine, prompts, params, batch_all: bool):
    t0, c0 = time.perf_counter(), time.process_time()
    if batch_all:
        outs = engine.generate(prompts, params)
    else:
        outs = [engine.generate([p], params)[0] for p in prompts]
    return time.perf_counter() - t0, time.process_time() - c0, [o.token_ids for o in outs]


def measure(prompts, params, batch_all: bool, repeats: int, modes: list[str]) -> list[dict]:
    """Modes interleaved within each repeat, so load from other processes on a shared machine hits
    them alike; the median repeat is reported."""
    engines = {mode: make_engine(mode) for mode in modes}
    for engine in engines.values():
        engine.generate(prompts[:2], params)                   # warm up
    before = {mode: e.stats() for mode, e in engines.items()}
    wall = {mode: [] for mode in modes}
    cpu = {mode: [] for mode in modes}
    outputs = {}
    for _ in range(repeats):
        for mode, engine in engines.items():
            w, c, outputs[mode] = timed(engine, prompts, params, batch_all)
            wall[mode].append(w)
            cpu[mode].append(c)
    rows = []
    for mode, engine in engines.items():
        st, b = engine.stats(), before[mode]
        tokens = sum(len(o) for o in outputs[mode])
        row = {"mode": mode, "batch": len(prompts) if batch_all else 1, "tokens": tokens,
               "ms_per_token": 1000 * statistics.median(wall[mode]) / tokens,
               "cpu_ms_per_token": 1000 * statistics.median(cpu[mode]) / tokens,
               "wall_s_all": wall[mode], "engine_steps": (st["num_steps"] - b["num_steps"]) / repeats,
               "identical_to_plain": outputs[mode] == outputs["plain"]}
        if "spec_num_steps" in st:
            def d(key):
                return st[key] - b[key]
            if d("spec_num_steps"):           # an adaptive mode may not have drafted at all
                row["mean_acceptance_length"] = d("spec_num_emitted_tokens") / d("spec_num_steps")
                row["acceptance_rate"] = d("spec_num_accepted_tokens") / d("spec_num_draft_tokens")
            row["time_ms_per_step"] = {k[len("spec_time_"):-3]: d(k) / d("num_steps")
                                       for k in st if k.startswith("spec_time_")}
            row["policy_steps"] = {k: d(f"spec_num_{k}_steps") for k in ("drafted", "plain", "probe")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = ap.parse_args()
    modes = ["plain"] + [m for m in args.modes.split(",") if m != "plain"]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {', '.join(unknown)}")
    torch.set_num_threads(args.threads)
    prompts = held_out_prompts(args.num_prompts, args.prompt_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = measure(prompts, params, False, args.repeats, modes) + measure(prompts, params, True, args.repeats, modes)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "device": "cpu", "threads": args.threads, "num_prompts": len(prompts),
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_trained_pair_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# EAGLE-3 on the trained tiny pair, CPU ({args.threads} thread), commit {commit}", "",
             f"{len(prompts)} held-out prompts of {args.prompt_len} tokens, {args.max_tokens} greedy tokens each, "
             f"median of {args.repeats} repeats (modes interleaved). A shared 2-core machine: wall times move by "
             "tens of percent between runs; CPU time is steadier.", "",
             "| mode | batch | wall ms / token | CPU ms / token | speedup (wall) | speedup (CPU) | engine steps "
             "| drafted / plain steps | acceptance length | acceptance rate | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["mode"] == "plain")
        al = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
        rate = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
        ps = r.get("policy_steps")
        steps = f"{ps['drafted'] / args.repeats:.0f} / {ps['plain'] / args.repeats:.0f}" if ps else "-"
        lines.append(f"| {r['mode']} | {r['batch']} | {r['ms_per_token']:.2f} | {r['cpu_ms_per_token']:.2f} "
                     f"| {base['ms_per_token'] / r['ms_per_token']:.2f}x | {base['cpu_ms_per_token'] / r['cpu_ms_per_token']:.2f}x "
                     f"| {r['engine_steps']:.0f} | {steps} | {al} | {rate} | {r['identical_to_plain']} |")
    lines += ["", "Speculative time per engine step by phase (ms; 'verify' is the whole packed target forward):", ""]
    for r in rows:
        if "time_ms_per_step" in r:
            lines.append(f"- {r['mode']} batch {r['batch']}: "
                         + ", ".join(f"{k} {v:.2f}" for k, v in r["time_ms_per_step"].items()))
    (out / "spec_trained_pair_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
