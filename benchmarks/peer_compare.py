"""llmserve beside a real serving engine, nano-vllm, on the same work in one call.

The peer and its harness live in .peer/ (copied there from the shared peers folder; see its README):
.peer/harness/common.py defines the workload both engines run, each in its own process, one after the
other: a small warm-up, batch-1 decode per token as (t272 - t16) / 256 twice, then 64 and 256 prompts of
512 random token ids x 256 new tokens, temperature 1.0 with ignore_eos (nano-vllm refuses temperature 0),
the same seeded prompts for both. nano-vllm runs through .peer/harness/run_nanovllm.py (random weights,
FlashAttention-4 through the harness's flash_attn shim); ours is the in-process Engine on the dummy
Qwen3-8B shape with its defaults (bf16, CUDA graphs, warm-up, triton-fa4 attention where FA4 imports).

    python3 benchmarks/peer_compare.py --peer .peer --out OUT_DIR [--skip-peer] [--baseline TREE]

--baseline TREE also runs an earlier llmserve (a checkout of another commit, e.g. the one before a
change that must cost nothing) on the same work in the same call, and adds its table: this tree's
speed over the baseline's.

Writes OUT_DIR/peer_compare.json (both engines' harness results whole, the ratios, exit statuses),
OUT_DIR/peer_compare.md (the table with the ratios: batch-1 decode speed, offline throughput at 64 and
256 prompts; above 1 means llmserve is faster) and OUT_DIR/peer.log (both processes' output), and prints
the table last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_ours(peer: str, out_json: str, model_dir: str | None) -> None:
    """Our Engine through the harness's run_workload (this process is the child the parent started).
    model_dir None: the dummy Qwen3-8B shape at max_model_len 4096, as nano-vllm runs it."""
    sys.path.insert(0, os.path.join(peer, "harness"))
    sys.path.insert(0, HERE)
    from common import run_workload
    from qwen3_8b import write_qwen3_8b_dir

    from llmserve_core import Engine, EngineConfig
    from llmserve_proto import SamplingParams

    t0 = time.perf_counter()
    max_model_len = 4096 if model_dir is None else None
    model_dir = model_dir or write_qwen3_8b_dir(os.path.join(tempfile.mkdtemp(), "qwen3-8b-dummy"))
    # The peer's own settings where both have one: 256 sequences, a 16,384-token step budget.
    engine = Engine(EngineConfig(model=model_dir, load_format="dummy", max_model_len=max_model_len,
                                 max_num_seqs=256, max_num_batched_tokens=16384, gpu_memory_utilization=0.85))
    extra = {"init_s": round(time.perf_counter() - t0, 1), "attention_backend": engine.runner.attn_backend.name,
             "block_size": engine.config.block_size, "warmup": engine.warmup_report,
             "total_kv_blocks": engine.stats()["total_kv_blocks"]}
    jit_per_call = []

    def gen(prompts, max_tokens):
        before = engine.stats()["jit_compilations"]
        outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
        jit_per_call.append(engine.stats()["jit_compilations"] - before)
        return [c.token_ids for c in outs]

    res = run_workload("llmserve", gen, out_json, extra)
    # run_workload counts files in Triton's cache folder; the engine's own counter sees every variant
    # built or loaded in this process, FA4's included.
    res["engine_jit_per_timed_run"] = jit_per_call
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)


def child(cmd: list[str], env: dict, log_path: str, timeout: float) -> int | str:
    """Run one engine's process, its output appended to the shared log; its exit status or 'timeout'."""
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        try:
            return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


def commit_of(tree: str) -> str:
    """The tree's commit: its .commit file where one is written (a device copy's .git may be stale), else git."""
    path = os.path.join(tree, ".commit")
    if os.path.exists(path):
        return open(path).read().strip()
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def load(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def get(d, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


PEER_TARGETS = {"batch1": 1.15, "tput_256": 1.3}


def compare(ours: dict | None, other: dict | None, other_name: str = "nano-vllm",
            targets: dict | None = PEER_TARGETS) -> tuple[dict, str]:
    """Ratios, each as ours over the other engine in speed (so > 1 means llmserve here is faster)."""
    rows, ratios = [], {}
    metrics = [("batch-1 decode, ms per token", ("batch1", "ms_per_token"), False),
               ("64 x (512 in, 256 out), output tok/s", ("tput_64", "tok_per_s"), True),
               ("256 x (512 in, 256 out), output tok/s", ("tput_256", "tok_per_s"), True),
               ("64 prompts, best pass tok/s", ("tput_64", "best_tok_per_s"), True),
               ("256 prompts, best pass tok/s", ("tput_256", "best_tok_per_s"), True)]
    for label, path, higher_better in metrics:
        a, b = get(ours, *path), get(other, *path)
        target = (targets or {}).get(path[0]) if path[1] != "best_tok_per_s" else None
        ratio = None
        if a and b:
            ratio = a / b if higher_better else b / a
            ratios[".".join(path)] = ratio
        cell = "-" if ratio is None else f"{ratio:.2f}x" + (
            "" if target is None else f" ({'met' if ratio >= target else 'missed'}: >= {target}x)")
        fmt = "{:.3f}" if not higher_better else "{:.0f}"
        rows.append(f"| {label} | {fmt.format(a) if a else '-'} | {fmt.format(b) if b else '-'} | {cell} |")
    jit = [f"llmserve {get(ours, 'engine_jit_per_timed_run')}",
           f"{other_name} {get(other, 'engine_jit_per_timed_run') or [j.get('new_jit') for j in get(other, 'jit_log') or []]}"]
    table = "\n".join([f"| metric | llmserve | {other_name} | llmserve speed / {other_name} |", "|---|---|---|---|", *rows,
                       "", f"Kernels compiled per timed run (warm-up, 2 x batch 1 x 2, then 64 / 256 prompts): "
                       f"{'; '.join(jit)}"])
    return ratios, table


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", default=".peer", help="the folder holding nano-vllm/ and harness/")
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-peer", action="store_true", help="run only ours (the peer's JSON may exist)")
    ap.add_argument("--repeats", default="2", help="passes over the 64 / 256 prompt runs (REPEATS)")
    ap.add_argument("--timeout-s", type=float, default=280, help="per engine process")
    ap.add_argument("--model", help="our model dir instead of the dummy Qwen3-8B shape (smoke runs)")
    ap.add_argument("--baseline", metavar="TREE", help="an earlier llmserve checkout to run on the same work too")
    ap.add_argument("--ours-child", metavar="OUT_JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    peer = os.path.abspath(args.peer)
    if args.ours_child:
        return run_ours(peer, args.ours_child, args.model)
    os.makedirs(args.out, exist_ok=True)
    env = {**os.environ, "REPEATS": args.repeats, "PYTHONUNBUFFERED": "1"}
    # The harness's own result files stay out of OUT_DIR: peer_compare.json holds them whole.
    work = tempfile.mkdtemp(prefix="peer-compare-")
    nano_json, ours_json = os.path.join(work, "nano.json"), os.path.join(work, "ours.json")
    log_path = os.path.join(args.out, "peer.log")
    status = {}
    if not args.skip_peer:
        nano_env = {**env, "PYTHONPATH": os.pathsep.join([os.path.join(peer, "nano-vllm"), env.get("PYTHONPATH", "")])}
        status["nano-vllm"] = child([sys.executable, os.path.join(peer, "harness", "run_nanovllm.py"),
                                     os.path.join(peer, "harness", "model"), nano_json], nano_env,
                                    log_path, args.timeout_s)
    ours_env = {**env, "PYTHONPATH": os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])}
    status["llmserve"] = child([sys.executable, os.path.abspath(__file__), "--peer", peer, "--out", args.out,
                                "--ours-child", ours_json] + (["--model", args.model] if args.model else []),
                               ours_env, log_path, args.timeout_s)
    base = None
    if args.baseline:
        tree = os.path.abspath(args.baseline)
        base_json = os.path.join(work, "baseline.json")
        status["baseline"] = child([sys.executable, os.path.join(tree, "benchmarks", "peer_compare.py"), "--peer", peer,
                                    "--out", args.out, "--ours-child", base_json]
                                   + (["--model", args.model] if args.model else []),
                                   {**env, "PYTHONPATH": os.pathsep.join([tree, env.get("PYTHONPATH", "")])},
                                   log_path, args.timeout_s)
        base = load(base_json)
    ours, nano = load(ours_json), load(nano_json)
    ratios, table = compare(ours, nano)
    commit = commit_of(ROOT)
    result = {"commit": commit, "exit_status": status, "ratios": ratios, "ours": ours, "nano": nano}
    text = f"# llmserve vs nano-vllm, same prompts, one call (commit {commit})\n\n{table}\n"
    if args.baseline:
        name = f"llmserve {commit_of(args.baseline)}"
        result["baseline"] = {"tree": args.baseline, "commit": commit_of(args.baseline), "result": base,
                              "ratios": compare(ours, base, name, targets=None)[0]}
        table += "\n\n" + compare(ours, base, name, targets=None)[1]
        text += f"\n## This tree against {name}, same prompts, same call\n\n{compare(ours, base, name, targets=None)[1]}\n"
    with open(os.path.join(args.out, "peer_compare.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "peer_compare.md"), "w") as f:
        f.write(text)
    print(table)
    return 0 if all(v == 0 for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
