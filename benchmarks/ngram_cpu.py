"""Prompt-lookup (ngram) speculation on a copy-heavy workload with the shipped trained tiny model, on the CPU.

The workload: each prompt holds a text that the answer repeats with small edits. For every held-out corpus
prompt P (which training never saw), the target's own greedy continuation G is computed first; the prompt is
then T' + "\\n\\n" + P, where T' is P + G with a few tokens replaced at random. Asked to continue P again,
the model largely retells G, so its answer copies long runs of T' and breaks off at the edits (and where
the new context changes its mind): the situation of an agent editing a file it was sent.

Reports, per setting (drafts per step, n-gram bounds, policy): the acceptance length (tokens emitted per
request per verify, 1.0 when nothing is accepted; requests with no match count too), the acceptance rate
of the drafts proposed, the share of request-steps that found a match, engine steps, CPU and wall time per
token, and that the output equals plain decoding token for token. The tiny model's forward is mostly fixed
overhead, so the times say how many steps speculation saves, not what a GPU gains (see ngram_timing.py).

    python benchmarks/ngram_cpu.py [--num-prompts 16] [--max-tokens 64] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import random
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

TARGET = ROOT / "llmserve_core/data/trained_pair/target"
# name: (drafts per step, prompt_lookup_min, prompt_lookup_max, policy)
SETTINGS = {"k3-2..4": (3, 2, 4, "always"), "k5-2..4": (5, 2, 4, "always"), "k8-2..4": (8, 2, 4, "always"),
            "k5-1..4": (5, 1, 4, "always"), "k5-5..5": (5, 5, 5, "always"), "k5-2..4-adaptive": (5, 2, 4, "adaptive")}


def held_out_prompts(n: int, length: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    from llmserve_core.data import corpus_paragraphs
    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    held = [p for i, p in enumerate(corpus_paragraphs()) if i % 20 == 19]
    return [ids[:length] for ids in (tok.encode(t).ids for t in held) if len(ids) >= length][:n]


def copy_heavy_prompts(engine: Engine, num_prompts: int, prompt_len: int = 24, text_len: int = 64,
                       edits: int = 3, seed: int = 0) -> list[list[int]]:
    """Prompts holding a text (a held-out prompt and the model's own continuation, a few tokens edited) that
    the answer repeats: the text, a blank line, then the held-out prompt again."""
    from tokenizers import Tokenizer
    sep = Tokenizer.from_file(str(TARGET / "tokenizer.json")).encode("\n\n").ids
    starts = held_out_prompts(num_prompts, prompt_len)
    greedy = SamplingParams(max_tokens=text_len, temperature=0.0, ignore_eos=True)
    rnd = random.Random(seed)
    prompts = []
    for start, out in zip(starts, engine.generate(starts, greedy)):
        text = start + out.token_ids
        for _ in range(edits):
            text[rnd.randrange(len(text))] = rnd.randrange(3, engine.model_info.vocab_size)
        prompts.append(text + sep + start)
    return prompts


def make_engine(setting: str | None) -> Engine:
    extra = {}
    if setting is not None:
        k, lo, hi, policy = SETTINGS[setting]
        extra = dict(speculative_method="ngram", speculative_gamma=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                     speculative_policy=policy)
    return Engine(EngineConfig(model=str(TARGET), device="cpu", dtype="float32", enable_prefix_caching=False,
                               num_kv_blocks=1024, **extra))


def run(engine: Engine, prompts, params, batch_all: bool) -> tuple[float, float, list[list[int]], dict]:
    before = engine.stats()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params) if batch_all else [engine.generate([p], params)[0] for p in prompts]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = engine.stats()
    return wall, cpu, [o.token_ids for o in outs], {k: after[k] - before[k] for k in after
                                                    if isinstance(after[k], (int, float)) and k in before}


def measure(prompts, params, batch_all: bool, settings: list[str]) -> list[dict]:
    engines = {None: make_engine(None), **{s: make_engine(s) for s in settings}}
    for engine in engines.values():
        engine.generate(prompts[:2], params)                       # warm up
    rows, plain_out = [], None
    for setting, engine in engines.items():
        wall, cpu, outs, d = run(engine, prompts, params, batch_all)
        plain_out = outs if setting is None else plain_out
        tokens = sum(len(o) for o in outs)
        row = {"setting": setting or "plain", "batch": len(prompts) if batch_all else 1, "tokens": tokens,
               "engine_steps": d["num_steps"], "ms_per_token": 1000 * wall / tokens, "cpu_ms_per_token": 1000 * cpu / tokens,
               "identical_to_plain": outs == plain_out}
        if setting is not None and d.get("spec_num_steps"):
            k = SETTINGS[setting][0]
            row.update(acceptance_length=d["spec_num_emitted_tokens"] / d["spec_num_steps"],
                       acceptance_rate=d["spec_num_accepted_tokens"] / max(d["spec_num_draft_tokens"], 1),
                       matched_share=d["spec_num_draft_tokens"] / (k * d["spec_num_steps"]),
                       drafted_steps=d["spec_num_drafted_steps"], plain_steps=d["spec_num_plain_steps"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def host_cost(batch: int, context: int, k: int, lo: int, hi: int, steps: int) -> dict:
    """The proposer's host work per drafting step at `batch` requests of `context` tokens (copy-like
    sequences: runs of a shared text), each step growing every request by 1 .. k + 1 tokens (what a step
    emits; mostly copied on from the shared text, so most requests find a match): its index update (on_scheduled) and its drafts (propose, with the copy to the device; here the
    CPU). The indexes are built first, untimed per step (their cost per request is reported apart)."""
    from types import SimpleNamespace

    from llmserve_core.engine.batch_builder import HostToDevice
    from llmserve_core.engine.request import Request
    from llmserve_core.engine.scheduler import ScheduledBatch
    from llmserve_core.engine.spec.ngram import NgramProposer
    from llmserve_core.speculative.ngram import NgramIndex

    rnd = random.Random(0)
    vocab = 151936
    shared = [rnd.randrange(vocab) for _ in range(4096)]
    cfg = EngineConfig(model=str(TARGET), speculative_method="ngram", speculative_gamma=k, prompt_lookup_min=lo,
                       prompt_lookup_max=hi)
    proposer = NgramProposer(cfg)
    proposer.ctx = SimpleNamespace(device=torch.device("cpu"), staging=HostToDevice(torch.device("cpu"), pin=False))
    reqs, build = [], []
    for i in range(batch):
        tokens = []
        while len(tokens) < context:
            j = rnd.randrange(len(shared) - 200)
            tokens += shared[j:j + rnd.randrange(8, 200)] + [rnd.randrange(vocab)]
        req = Request(f"r{i}", tokens[:context], SamplingParams(), frozenset(), 10 ** 9)
        req.speculative, req.num_computed_tokens = True, context - 1
        t0 = time.perf_counter()
        req.spec_state = NgramIndex(lo, hi)
        req.spec_state.extend(req.token_ids, context)
        build.append(time.perf_counter() - t0)
        reqs.append(req)
    sched = ScheduledBatch(reqs, [1] * batch)
    index_ms, propose_ms, matched = [], [], 0
    cursors = [rnd.randrange(len(shared) - 200) for _ in reqs]
    for _ in range(steps):
        for i, req in enumerate(reqs):          # mostly copying on through the shared text, now and then a jump
            n = rnd.randint(1, k + 1)
            if rnd.random() < 0.1 or cursors[i] + n >= len(shared):
                cursors[i] = rnd.randrange(len(shared) - 200)
                req.token_ids.append(rnd.randrange(vocab))
            else:
                req.token_ids += shared[cursors[i]:cursors[i] + n]
                cursors[i] += n
            req.num_computed_tokens = req.num_tokens - 1
        t0 = time.perf_counter()
        proposer.on_scheduled(sched, None)
        t1 = time.perf_counter()
        proposal = proposer.propose(sched, reqs, k)
        t2 = time.perf_counter()
        index_ms.append(1000 * (t1 - t0))
        propose_ms.append(1000 * (t2 - t1))
        matched += sum(n > 0 for n in proposal.lengths)
    total = sorted(a + b for a, b in zip(index_ms, propose_ms))
    return {"batch": batch, "context": context, "k": k, "lookup": [lo, hi], "steps": steps,
            "build_ms_per_request": 1000 * statistics.median(build), "index_ms": statistics.median(index_ms),
            "propose_ms": statistics.median(propose_ms), "step_ms": statistics.median(total),
            "step_ms_p90": total[int(0.9 * (len(total) - 1))], "matched_share": matched / (steps * batch)}


def markdown(result: dict) -> str:
    lines = [f"# Prompt-lookup (ngram) speculation on the trained tiny model, cpu, commit {result['commit']}", "",
             f"{result['num_prompts']} copy-heavy prompts (a held-out prompt and the model's own {result['text_len']}-token "
             f"continuation with {result['edits']} tokens edited, a blank line, the prompt again), "
             f"{result['max_tokens']} greedy tokens each, one thread. Acceptance length: tokens emitted per request "
             "per verify (requests without a match count, at 1.0); matched: request-steps that found a match.", "",
             "| setting | batch | acceptance length | acceptance rate | matched | engine steps | drafted / plain steps "
             "| CPU ms / token | wall ms / token | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        def f(key, fmt="{:.2f}"):
            return fmt.format(r[key]) if key in r else "-"
        steps = f"{r['drafted_steps']} / {r['plain_steps']}" if "drafted_steps" in r else "-"
        lines.append(f"| {r['setting']} | {r['batch']} | {f('acceptance_length')} | {f('acceptance_rate')} "
                     f"| {f('matched_share')} | {r['engine_steps']} | {steps} | {r['cpu_ms_per_token']:.2f} "
                     f"| {r['ms_per_token']:.2f} | {r['identical_to_plain']} |")
    lines += ["", "Settings: kN = drafts per step, a..b = prompt_lookup_min..max; `always` drafts every step, "
              "`adaptive` is the default policy."]
    if result.get("host_cost"):
        lines += ["", f"The proposer's host work per drafting step ({result['host_cost'][0]['steps']} steps, each request "
                  "growing by 1 to k + 1 tokens a step; medians, p90 of the whole; index: building one request's "
                  "index once):", "", "| batch | context | k | n-grams | index update ms | propose ms | step ms | "
                  "step p90 ms | matched | index build ms / request |", "|---|---|---|---|---|---|---|---|---|---|"]
        for h in result["host_cost"]:
            lines.append(f"| {h['batch']} | {h['context']} | {h['k']} | {h['lookup'][0]}..{h['lookup'][1]} "
                         f"| {h['index_ms']:.3f} | {h['propose_ms']:.3f} | {h['step_ms']:.3f} | {h['step_ms_p90']:.3f} "
                         f"| {h['matched_share']:.2f} | {h['build_ms_per_request']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--text-len", type=int, default=64, help="tokens of the model's continuation held in each prompt")
    ap.add_argument("--edits", type=int, default=3, help="tokens of that text replaced at random")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of: " + ", ".join(SETTINGS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--host-batch", type=int, default=64, help="the host-cost run's batch (0: skip it)")
    ap.add_argument("--host-context", type=int, default=32768, help="the host-cost run's tokens per request")
    ap.add_argument("--host-steps", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = ap.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        ap.error(f"--settings: unknown {', '.join(unknown)}")
    torch.set_num_threads(args.threads)
    prompts = copy_heavy_prompts(make_engine(None), args.num_prompts, text_len=args.text_len, edits=args.edits)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = measure(prompts, params, True, settings) + measure(prompts, params, False, settings)
    costs = [host_cost(args.host_batch, args.host_context, k, lo, hi, args.host_steps)
             for k, lo, hi in ((5, 2, 4), (5, 5, 5), (8, 1, 8))] if args.host_batch else []
    for c in costs:
        print(json.dumps(c), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "device": "cpu", "threads": args.threads, "num_prompts": len(prompts),
              "text_len": args.text_len, "edits": args.edits, "max_tokens": args.max_tokens, "rows": rows,
              "host_cost": costs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ngram_trained_pair_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / "ngram_trained_pair_cpu.md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
