"""Pooling requests on one GPU, dummy weights, in one run (in-process engines, one after another):

  1. the card's copy bandwidth and bf16 matmul peak (benchmarks/floor.py);
  2. embedding throughput, Qwen3-Embedding-8B shape (Qwen3-8B without its lm_head: a Qwen3Model, the
     pooling runner), 512-token documents at each --budgets token budget: tokens/s and documents/s against
     the floor of those prompts' forward (floor.prompts_floor; the target is at least 50%);
  3. rerank throughput, Qwen3-Reranker-0.6B shape (Qwen3-0.6B, a causal LM scored on two tokens, under
     the pooling runner), 512-token pairs: pairs/s against their floor;
  4. generation beside embeddings, Qwen3-8B (the generate runner): mean TPOT and median ITL of 16 greedy
     requests in a closed loop (512 in, 128 out), alone, then with 512-token embedding requests kept queued
     beside them at the default budget and at --mixed-budget (decode-first chunked prefill: the embeddings
     take what budget the decodes leave), with the embedding throughput they got.
Every timed run reports the kernels the engine JIT-compiled inside it (its warm-up should leave none).

Usage: python benchmarks/embed_throughput.py --out DIR [--commit SHA]   # about 4 minutes on an H100
       python benchmarks/embed_throughput.py --out DIR --smoke          # every section on the tiny shape, CPU
Writes DIR/embed_throughput.json and DIR/embed_throughput.md; prints the table last.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from floor import measure_bf16_peak, measure_copy_bandwidth, prompts_floor  # noqa: E402
from qwen3_8b import QWEN3_8B_CONFIG, smoke_shape, write_qwen3_8b_dir  # noqa: E402

# Qwen3-0.6B's config.json (the shape of Qwen3-Reranker-0.6B).
QWEN3_06B = dict(QWEN3_8B_CONFIG, vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
EMBED_8B = dict(QWEN3_8B_CONFIG, architectures=["Qwen3Model"])
GPU = dict(device="cuda", vocab=(1000, 100000), doc_len=512, embed_docs=384, rerank_docs=1024, warm_docs=32,
           engine=dict(load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.85),
           gen=dict(max_num_seqs=64), gen_requests=16, gen_prompt=512, gen_output=128, gen_seconds=(2.0, 6.0),
           queued_docs=64)
SMOKE = dict(device="cpu", vocab=(3, 1000), doc_len=16, embed_docs=8, rerank_docs=8, warm_docs=2,
             engine=dict(load_format="dummy", max_model_len=256, device="cpu", num_kv_blocks=128),
             gen=dict(max_num_seqs=8), gen_requests=2, gen_prompt=8, gen_output=4, gen_seconds=(0.2, 0.5),
             queued_docs=4)


def engine(model_dir: str, p: dict, **kw):
    from llmserve_core import Engine, EngineConfig
    return Engine(EngineConfig(model=model_dir, **{**p["engine"], **kw}))


def free() -> None:
    """After `del engine`: collect its cycles and hand its memory back, so the next engine sizes its pool
    from the whole card."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def docs(rng: random.Random, p: dict, n: int) -> list[list[int]]:
    return [[rng.randrange(*p["vocab"]) for _ in range(p["doc_len"])] for _ in range(n)]


def pooling_run(eng, prompts, params) -> tuple[float, int]:
    """(seconds, kernels JIT-compiled) to run the prompts to the end, all queued at once."""
    jit0 = eng.stats()["jit_compilations"]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = eng.pool(prompts, params)
    seconds = time.perf_counter() - t0
    assert all(r.finish_reason == "stop" for r in results)
    return seconds, eng.stats()["jit_compilations"] - jit0


def throughput(name, eng, cfg, p, rates, rng, params, n, budget, head_rows, lm_head) -> dict:
    pooling_run(eng, docs(rng, p, p["warm_docs"]), params)          # untimed: this budget's shapes
    prompts = docs(rng, p, n)
    seconds, jit = pooling_run(eng, prompts, params)
    floor = prompts_floor(cfg, [len(d) for d in prompts], budget, *rates, head_rows=head_rows, lm_head=lm_head)
    tokens = n * p["doc_len"]
    return {"what": name, "budget": budget, "documents": n, "doc_len": p["doc_len"], "seconds": seconds,
            "docs_per_s": n / seconds, "tokens_per_s": tokens / seconds, "floor_ms": floor.ms, "bound": floor.bound,
            "fraction_of_floor": floor.ms / 1e3 / seconds, "jit_compilations": jit}


def embed_section(args, p, rates, rng, tmp) -> list[dict]:
    from llmserve_proto import PoolingParams
    cfg = smoke_shape() | {"architectures": ["Qwen3Model"]} if args.smoke else EMBED_8B
    model = write_qwen3_8b_dir(os.path.join(tmp, "embed"), **cfg)
    out = []
    eng = engine(model, p, max_num_batched_tokens=max(args.budgets), max_num_seqs=256)
    assert eng.runner_kind == "pooling"
    for budget in args.budgets:
        eng.scheduler.max_num_batched_tokens = budget      # the profiled peak was the largest budget's
        out.append(throughput("embed", eng, cfg, p, rates, rng, PoolingParams(), p["embed_docs"], budget, 0, False))
    del eng
    free()
    return out


def rerank_section(args, p, rates, rng, tmp) -> list[dict]:
    from llmserve_proto import PoolingParams
    cfg = smoke_shape() if args.smoke else QWEN3_06B
    model = write_qwen3_8b_dir(os.path.join(tmp, "rerank"), **cfg)
    budget = max(args.budgets)
    eng = engine(model, p, runner="pooling", max_num_batched_tokens=budget, max_num_seqs=256)
    params = PoolingParams(task="score", token_ids=[p["vocab"][0], p["vocab"][0] + 1])     # "yes", "no"
    # Only the two named rows of the (tied) head are read: no whole lm_head in the floor.
    row = throughput("rerank", eng, cfg, p, rates, rng, params, p["rerank_docs"], budget, 2, False)
    del eng
    free()
    return [row]


def generation_section(args, p, rng, tmp) -> list[dict]:
    from llmserve_proto import PoolingParams, SamplingParams
    model = write_qwen3_8b_dir(os.path.join(tmp, "gen"), **(smoke_shape() if args.smoke else {}))
    eng = engine(model, p, **p["gen"])
    default_budget = eng.scheduler.max_num_batched_tokens
    rows = []
    for label, load, budget in (("alone", False, default_budget), ("beside embeddings", True, default_budget),
                                ("beside embeddings", True, args.mixed_budget)):
        eng.scheduler.max_num_batched_tokens = budget
        rows.append({"what": f"generation {label}", "budget": budget,
                     **closed_loop(eng, p, rng, load, SamplingParams(max_tokens=p["gen_output"], temperature=0.0,
                                                                     ignore_eos=True), PoolingParams())})
    del eng
    free()
    return rows


def closed_loop(eng, p, rng, load: bool, sampling, pooling) -> dict:
    """`gen_requests` generations kept running (a finished one replaced at once) and, with `load`,
    `queued_docs` embedding requests kept queued beside them, each kind as a client of its own (admission
    is fair between clients); measured after a warm window."""
    n = 0
    tokens: dict[str, list[float]] = {}      # request -> arrival time of each of its outputs with tokens
    itls, tpots, docs_done = [], [], 0

    def add(kind: str):
        nonlocal n
        n += 1
        if kind == "gen":
            eng.add_request(f"g{n}", [rng.randrange(*p["vocab"]) for _ in range(p["gen_prompt"])], sampling,
                            client="chat")
        else:
            eng.add_pooling_request(f"e{n}", docs(rng, p, 1)[0], pooling, client="indexer")

    for _ in range(p["gen_requests"]):
        add("gen")
    for _ in range(p["queued_docs"] if load else 0):
        add("doc")
    warm, secs = p["gen_seconds"]
    jit0 = eng.stats()["jit_compilations"]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm + secs:
        for o in eng.step():
            t = time.perf_counter() - t0
            if o.pooled is not None:
                docs_done += t > warm and o.finish_reason == "stop"
                add("doc")
                continue
            times = tokens.setdefault(o.request_id, [])
            if o.new_token_ids:
                if times and t > warm:
                    itls.append(t - times[-1])
                times += [t] * len(o.new_token_ids)
            if o.finish_reason is not None:
                times = tokens.pop(o.request_id)
                if times and times[0] > warm and len(times) > 1:
                    tpots.append((times[-1] - times[0]) / (len(times) - 1))
                add("gen")
    for rid in list(eng.requests):
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    itls.sort()
    return {"mean_tpot_ms": 1e3 * sum(tpots) / len(tpots) if tpots else None, "requests_timed": len(tpots),
            "median_itl_ms": 1e3 * itls[len(itls) // 2] if itls else None,
            "embed_docs_per_s": docs_done / secs if load else None,
            "jit_compilations": eng.stats()["jit_compilations"] - jit0}


def table(rows: list[dict], rates) -> str:
    lines = [f"copy bandwidth {rates[0] / 1e12:.2f} TB/s, bf16 peak {rates[1] / 1e12:.0f} TFLOP/s",
             f"{'measurement':<30} {'budget':>6} {'docs/s':>9} {'tokens/s':>10} {'of floor':>9} "
             f"{'TPOT ms':>8} {'ITL ms':>7} {'jit':>4}"]
    for r in rows:
        frac = r.get("fraction_of_floor")
        docs_per_s = r.get("docs_per_s") or r.get("embed_docs_per_s")
        lines.append(f"{r['what']:<30} {r['budget']:>6} {_f(docs_per_s, '.1f'):>9} "
                     f"{_f(r.get('tokens_per_s'), '.0f'):>10} {_f(None if frac is None else 100 * frac, '.0f%'):>9} "
                     f"{_f(r.get('mean_tpot_ms'), '.2f'):>8} {_f(r.get('median_itl_ms'), '.2f'):>7} "
                     f"{r['jit_compilations']:>4}")
    return "\n".join(lines)


def _f(x, fmt: str) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}%" if fmt == ".0f%" else format(x, fmt)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for embed_throughput.{json,md}")
    ap.add_argument("--budgets", default="8192,16384", help="token budgets of the embedding runs (default: 8192,16384)")
    ap.add_argument("--mixed-budget", type=int, default=2048,
                    help="the smaller budget generation runs beside embeddings at (default: 2048)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["embed", "rerank", "generation"])
    ap.add_argument("--commit", default=None, help="the commit measured (default: .commit or git)")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU: checks the script runs")
    args = ap.parse_args()
    args.budgets = sorted(int(b) for b in args.budgets.split(","))
    if args.smoke:
        args.budgets, args.mixed_budget = [32, 64], 16
    p = SMOKE if args.smoke else GPU
    os.makedirs(args.out, exist_ok=True)
    rates = (1e11, 1e12) if args.smoke else (measure_copy_bandwidth(), measure_bf16_peak())
    rng = random.Random(0)
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("embed", lambda: embed_section(args, p, rates, rng, tmp)),
                          ("rerank", lambda: rerank_section(args, p, rates, rng, tmp)),
                          ("generation", lambda: generation_section(args, p, rng, tmp))):
            if name in args.skip:
                continue
            start = time.time()
            rows += run()
            print(f"== {name}: {time.time() - start:.0f} s", flush=True)
    card = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    result = {"card": card, "commit": args.commit or _commit(), "copy_bandwidth_tb_per_s": rates[0] / 1e12,
              "bf16_peak_tflop_per_s": rates[1] / 1e12, "seconds": time.time() - t0, "rows": rows}
    text = table(rows, rates)
    with open(os.path.join(args.out, "embed_throughput.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "embed_throughput.md"), "w") as f:
        f.write(f"# Pooling throughput on {card} ({result['commit']})\n\n```\n{text}\n```\n")
    print(text)
    return 0


def _commit() -> str | None:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".commit")
    if os.path.isfile(path):
        return open(path).read().strip()
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
