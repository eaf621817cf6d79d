"""Does speculation pay, or at least never cost, when serving? Closed loops over IPC, speculation on and
off, in one call.

  8b      Qwen3-8B shape with a dummy EAGLE-3 draft (RedHatAI's speculator shape): random weights accept
          almost nothing, the worst case for speculation, so the adaptive policy must serve within a few
          percent of a core without a draft. Concurrency 1, 16, 64, 256; 512 in / 256 out.
  trained the shipped trained tiny pair on natural prompts at concurrency 1 and 8: plain, drafting every
          step (policy always) and adaptive. The model is tiny, so a step is mostly fixed per-forward
          cost: this shows the executor's overhead, not what an 8B model gains.

    python benchmarks/spec_serving.py --out $OUT/serving [--quick] [--only 8b|trained]
    python benchmarks/spec_serving.py --out /tmp/serving --smoke    # the 8b section on tiny models, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from h200_e2e import bench, pick, start_core, stop_core  # noqa: E402
from spec_timing import write_models  # noqa: E402

PAIR = ROOT / "llmserve_core" / "data" / "trained_pair"
STEP_KEYS = ("spec_num_drafted_steps", "spec_num_plain_steps", "spec_num_probe_steps")


def loops(endpoint: str, out_dir: str, tag: str, concurrencies, argv: list[str], warm: str, secs: str) -> dict:
    res = {}
    for c in concurrencies:
        summary = bench(endpoint, ["closed-loop", "--max-concurrency", str(c), "--warmup-seconds", warm,
                                   "--measurement-seconds", secs, "--no-progress"] + argv,
                        os.path.join(out_dir, f"{tag}_c{c}.json"))
        res[f"c{c}"] = {**pick(summary), **{k: summary[k] for k in summary if k.startswith("core_spec")}}
        print(f"[{tag}] c{c}: {res[f'c{c}'].get('output_throughput', 0):.1f} tok/s", flush=True)
    return res


def run_8b(args, tmp: Path) -> dict:
    target, draft = write_models(tmp, smoke=args.smoke)
    common = ["--max-model-len", "2048", "--max-num-seqs", "256", "--gpu-memory-utilization", "0.85"]
    argv = ["--input-len", "512", "--output-len", "256", "--prompt-mode", "random"]
    windows = ("3", "8") if args.quick else ("5", "15")
    if args.smoke:      # the tiny target and draft on the CPU, for seconds
        common = ["--max-model-len", "512", "--max-num-seqs", "4", "--device", "cpu", "--num-kv-blocks", "256"]
        argv, windows = ["--input-len", "16", "--output-len", "8", "--prompt-mode", "random"], ("0.5", "1")
    out = {}
    for tag, extra in (("plain", []), ("spec_adaptive", ["--speculative-model", draft, "--speculative-policy", "adaptive"])):
        endpoint = f"ipc://{tmp}/{tag}.sock"
        core = start_core(target, endpoint, common + extra)                   # dummy weights
        try:
            out[tag] = loops(endpoint, args.out, f"8b_{tag}", args.concurrency, argv, *windows)
        finally:
            stop_core(core)
    out["ratio_spec_over_plain"] = {c: out["spec_adaptive"][c]["output_throughput"] /
                                    max(out["plain"][c]["output_throughput"], 1e-9) for c in out["plain"]}
    return out


def run_trained(args, tmp: Path) -> dict:
    argv = ["--input-len", "64", "--output-len", "128", "--prompt-mode", "natural"]
    out = {}
    variants = (("plain", []),
                ("spec_always", ["--speculative-model", str(PAIR / "draft"), "--speculative-policy", "always"]),
                ("spec_adaptive", ["--speculative-model", str(PAIR / "draft"), "--speculative-policy", "adaptive"]))
    for tag, extra in variants:
        endpoint = f"ipc://{tmp}/pair-{tag}.sock"
        core = start_core(str(PAIR / "target"), endpoint, ["--max-num-seqs", "64", "--gpu-memory-utilization", "0.3"]
                          + extra, load_format="auto")
        try:
            out[tag] = loops(endpoint, args.out, f"pair_{tag}", (1, 8), argv, "2", "5" if args.quick else "10")
        finally:
            stop_core(core)
    out["ratio_over_plain"] = {tag: {c: out[tag][c]["output_throughput"] / out["plain"][c]["output_throughput"]
                                     for c in out["plain"]} for tag, _ in variants[1:]}
    return out


def markdown(res: dict) -> str:
    lines = [f"# Speculation while serving, closed loops over IPC, commit {res['commit']}", ""]
    if "8b" in res and "error" not in res["8b"]:
        r = res["8b"]
        lines += ["Qwen3-8B shape + dummy EAGLE-3 draft (accepts ~nothing), 512 in / 256 out, output tok/s:", "",
                  "| concurrency | plain | spec adaptive | ratio | drafted / plain / probe steps | measured draft/plain step cost |",
                  "|---|---|---|---|---|---|"]
        for c, ratio in r["ratio_spec_over_plain"].items():
            s = r["spec_adaptive"][c]
            steps = " / ".join(str(s.get(f"core_{k}", "-")) for k in STEP_KEYS)
            cost = s.get("core_spec_policy_cost_ratio")
            lines.append(f"| {c[1:]} | {r['plain'][c]['output_throughput']:.0f} | {s['output_throughput']:.0f} | "
                         f"{ratio:.3f} | {steps} | {f'{cost:.2f}' if isinstance(cost, (int, float)) else '-'} |")
        lines.append("")
    if "trained" in res and "error" not in res["trained"]:
        r = res["trained"]
        lines += ["Shipped trained tiny pair, natural prompts, 64 in / 128 out, output tok/s (a tiny model: this is the "
                  "executor's fixed overhead, not an 8B model's gain):", "",
                  "| concurrency | plain | spec always | x | spec adaptive | x | acceptance length |",
                  "|---|---|---|---|---|---|---|"]
        for c in r["plain"]:
            a, d = r["spec_always"][c], r["spec_adaptive"][c]
            lines.append(f"| {c[1:]} | {r['plain'][c]['output_throughput']:.0f} | {a['output_throughput']:.0f} | "
                         f"{r['ratio_over_plain']['spec_always'][c]:.2f} | {d['output_throughput']:.0f} | "
                         f"{r['ratio_over_plain']['spec_adaptive'][c]:.2f} | "
                         f"{a.get('core_spec_mean_acceptance_length', '-')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["8b", "trained"])
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--concurrency", default=None, type=lambda v: [int(c) for c in v.split(",")],
                    help="the 8B section's concurrencies (default 1,16,64,256)")
    ap.add_argument("--smoke", action="store_true",
                    help="the 8b section on tiny models on the CPU at concurrency 2, in seconds (checks the script runs)")
    args = ap.parse_args()
    args.concurrency = args.concurrency or ([2] if args.smoke else [1, 16, 64, 256])
    if args.smoke and args.only is None:
        args.only = "8b"
    os.makedirs(args.out, exist_ok=True)
    res = {"commit": args.commit}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("trained", run_trained), ("8b", run_8b)):
            if args.only in (None, name):
                try:
                    res[name] = fn(args, Path(tmp))
                except Exception as e:       # keep what the other section measured
                    import traceback
                    traceback.print_exc()
                    res[name] = {"error": f"{type(e).__name__}: {e}"}
    Path(args.out, "spec_serving.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    Path(args.out, "spec_serving.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
