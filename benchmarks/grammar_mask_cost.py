"""What a JSON-schema token mask costs per decode step, at the Qwen3-8B shape (dummy weights).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/grammar_mask_cost.py --out $OUT/grammar.json   # the GPU
    python benchmarks/grammar_mask_cost.py --smoke --out /tmp/grammar_smoke.json              # tiny, CPU

For batch 1 and 64 the engine decodes with every row under the same JSON schema (compiled once, cached)
and without any, finished requests replaced so the batch stays full; only steps in which all rows decode
are timed. Steps with grammar rows keep async scheduling's overlap: their forward is launched before the
previous step is read back, and only their sampling waits for that readback (the mask needs the previous
token). So the JSON mask is held against the async step without one (the target); a third run, no mask
with async scheduling off, is the step with no overlap at all, for reference.
Components timed alone: filling the bitmask on the host (xgrammar), and applying it on the device
(xgrammar's kernel vs the torch reference).

The real Qwen3 tokenizer cannot be downloaded here, so the vocabulary is synthetic: 151,643 byte-level
tokens (the 256 bytes, then corpus substrings of 2-12 bytes with and without a leading space), plus
Qwen3's special tokens. Mask cost depends on the vocabulary's size and shape, which this matches roughly.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_trace import busy_us, profile_calls  # noqa: E402
from qwen3_8b import QWEN3_8B_CONFIG, write_qwen3_8b_dir  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "year", "tags", "summary"],
          "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "summary": {"type": "string"}}}


def write_synthetic_tokenizer(path: str, num_tokens: int) -> None:
    """A byte-level BPE tokenizer.json with num_tokens ordinary tokens and Qwen3's three specials after them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from llmserve_core.data import corpus_paragraphs

    byte_chars = ByteLevel.alphabet()
    table = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    vocab: dict[str, int] = {}
    for c in sorted(byte_chars):
        vocab.setdefault(c, len(vocab))
    words = " ".join(corpus_paragraphs()).split()
    for length in range(2, 13):
        for w in words:
            for start in range(0, max(1, len(w) - length + 1)):
                piece = w[start:start + length].encode()
                for cand in (piece, b" " + piece):
                    tok = "".join(table[b] for b in cand)
                    if tok not in vocab:
                        vocab[tok] = len(vocab)
                        if len(vocab) == num_tokens:
                            break
                if len(vocab) == num_tokens:
                    break
            if len(vocab) == num_tokens:
                break
    k = 0
    while len(vocab) < num_tokens:           # the corpus ran out: numbered filler pieces
        vocab.setdefault("".join(table[b] for b in f"x{k}".encode()), len(vocab))
        k += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>"}, f)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (what ByteLevel uses), in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def timed_steps(engine, batch: int, params, steps: int, warmup: int, prompt_len: int, vocab: int) -> list[float]:
    """Step times (ms) of steps where all `batch` rows decode; finished requests are replaced. Each is the
    wall clock of Engine.step() as a server calls it, never bracketed by a device synchronize: with async
    scheduling a step returns once the step before it is read back, so in steady decoding this is the
    device's step period with whatever host work it fails to hide."""
    import random
    rng = random.Random(0)
    live, made, times = set(), 0, []

    def add():
        nonlocal made
        rid = f"r{made}"
        made += 1
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(prompt_len)], params(made))
        live.add(rid)

    for _ in range(batch):
        add()
    while len(times) < steps + warmup:
        t0 = time.perf_counter()
        outs = engine.step()
        dt = (time.perf_counter() - t0) * 1000
        if engine.num_tokens_scheduled == batch and len(engine.scheduler.running) == batch:
            times.append(dt)
        for o in outs:
            if o.finish_reason is not None:
                live.discard(o.request_id)
                add()
    for rid in list(live):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return times[warmup:]


def profile_steps(engine, batch: int, params, prompt_len: int, vocab: int, name: str, steps: int = 20) -> dict:
    """Where a step's time goes: the host's functions over `steps` steps (cProfile, printed) and the GPU's
    busy time against the wall clock (torch profiler kernel intervals, merged)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    timed_steps(engine, batch, params, steps, 2, prompt_len, vocab)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
    print(f"== host profile, {name}, batch {batch}, {steps} steps\n" + text.getvalue()[:6000], flush=True)
    if not torch.cuda.is_available():
        return {}
    kernels, wall = profile_calls(lambda: timed_steps(engine, batch, params, steps, 2, prompt_len, vocab), 1)
    busy = busy_us(kernels) / 1000
    out = {"wall_ms": wall, "gpu_busy_ms": busy, "busy_fraction": busy / wall}
    print(f"== GPU, {name}, batch {batch}: {json.dumps(out)}", flush=True)
    return out


def component_times(engine, batch: int, vocab: int, reps: int) -> dict:
    """Host bitmask fill (xgrammar), and the device mask apply: xgrammar's kernel vs the torch reference."""
    import xgrammar as xgr
    from llmserve_core.layers.logits_processors import apply_token_bitmask, apply_token_bitmask_reference
    from llmserve_proto import GuidedDecoding

    g = engine.grammars.submit(GuidedDecoding(kind="json", spec=json.dumps(SCHEMA)))
    compiled = g.future.result()
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    for m in matchers:
        assert m.accept_string('{"title": "a')       # mid-string: the widest mask, the usual state
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    bm = xgr.BatchGrammarMatcher()
    rows = list(range(batch))
    t0 = time.perf_counter()
    for _ in range(reps):
        if batch == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            bm.batch_fill_next_token_bitmask(matchers, bitmask, rows)
    fill = (time.perf_counter() - t0) * 1000 / reps
    dev = engine.runner.device
    logits = torch.randn(batch, vocab, device=dev)
    dbm = bitmask.to(dev)

    def time_apply(fn) -> float:
        for _ in range(3):
            fn(logits.clone(), dbm, rows)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn(logits.clone(), dbm, rows)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1000 / reps

    copy = time_apply(lambda lg, b, r: lg)          # the clone alone, subtracted below
    return {"fill_host_ms": fill, "apply_kernel_ms": max(0.0, time_apply(apply_token_bitmask) - copy),
            "apply_torch_reference_ms": max(0.0, time_apply(apply_token_bitmask_reference) - copy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script runs)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also profile steps at the largest batch: host functions (cProfile) and GPU busy vs wall")
    args = ap.parse_args()

    from llmserve_core import Engine, EngineConfig
    from llmserve_proto import GuidedDecoding, SamplingParams

    tmp = tempfile.mkdtemp(prefix="grammar-bench-")
    if args.smoke:
        from llmserve_core.models.tiny import make_tiny_model
        model = make_tiny_model(os.path.join(tmp, "tiny"))
        vocab, batches, steps, warmup, prompt_len = 1024, (1, 8), args.steps or 10, 3, 16
        base = dict(device="cpu", num_kv_blocks=512, max_model_len=512)
    else:
        model = write_qwen3_8b_dir(os.path.join(tmp, "qwen3-8b"))
        vocab = QWEN3_8B_CONFIG["vocab_size"]
        write_synthetic_tokenizer(model, 151643)
        batches, steps, warmup, prompt_len = (1, 64), args.steps or 60, 10, 128
        # Three engines one after another: each takes a fixed share, so a late-freed one cannot starve the next.
        base = dict(load_format="dummy", max_model_len=2048, max_num_seqs=64, gpu_memory_utilization=0.45)
    schema = GuidedDecoding(kind="json", spec=json.dumps(SCHEMA))
    plain = lambda i: SamplingParams(max_tokens=256, temperature=1.0, seed=i, ignore_eos=True)
    guided = lambda i: SamplingParams(max_tokens=256, temperature=1.0, seed=i, guided=schema)
    results = {"model": "Qwen3-8B shape, dummy weights" if not args.smoke else "tiny (smoke)",
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
               "schema": SCHEMA, "rows": []}
    for batch in batches:
        row = {"batch": batch}
        for name, params, extra in (("none_async", plain, {}), ("none_sync", plain, {"async_scheduling": False}),
                                    ("json_schema", guided, {})):
            engine = Engine(EngineConfig(model=model, **base, **extra))
            times = timed_steps(engine, batch, params, steps, warmup, prompt_len, vocab)
            row[f"{name}_ms"] = statistics.median(times)
            row[f"{name}_steps"] = len(times)
            if name == "json_schema":
                row.update(component_times(engine, batch, vocab, reps=50))
            if args.profile and batch == batches[-1] and name != "none_sync":
                row[f"{name}_profile"] = profile_steps(engine, batch, params, prompt_len, vocab, name)
            engine.grammars.shutdown()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        row["overhead_vs_async_pct"] = 100 * (row["json_schema_ms"] / row["none_async_ms"] - 1)
        row["overhead_vs_sync_pct"] = 100 * (row["json_schema_ms"] / row["none_sync_ms"] - 1)
        results["rows"].append(row)
    print(f"{'batch':>5} {'no mask (async)':>15} {'no mask (sync)':>14} {'json mask':>10} {'vs async':>9} "
          f"{'vs sync':>8} {'fill (host)':>11} {'apply':>8} {'apply (torch)':>13}")
    for r in results["rows"]:
        print(f"{r['batch']:>5} {r['none_async_ms']:>12.2f} ms {r['none_sync_ms']:>11.2f} ms {r['json_schema_ms']:>7.2f} ms "
              f"{r['overhead_vs_async_pct']:>8.1f}% {r['overhead_vs_sync_pct']:>7.1f}% {r['fill_host_ms']:>8.3f} ms "
              f"{r['apply_kernel_ms']:>5.3f} ms {r['apply_torch_reference_ms']:>10.3f} ms")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
