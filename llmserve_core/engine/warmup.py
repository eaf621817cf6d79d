"""Warm-up: run the engine through every kind of step it can take before it says it is ready, so that no
kernel compiles inside a served request (a Triton or FlashAttention-4 compile costs seconds).

Kernels compile per dtype, per constexpr (tile configs, which follow the query length: decode, short
and long prefill, tree verify; the decode kernel's key tile and whether it splits, which follow the
split count and so the batch size; the fused q/k + K/V store kernel, per cache dtype) and per shape class
that a kernel specializes on; the warm-up drives real requests through the real step (scheduler, batch
builder, CUDA graphs, speculative draft and verify, sampler), so whatever a kernel specializes on, the
shapes a served step can have are met here first:
- a prompt of every length 1..16 (the row counts small-M GEMV kernels specialize on), lengths at each
  tile boundary and every power of two up to a full token budget, and one longer than the budget (chunked:
  an extend); where a prompt cannot be that long, several fill a step to each power of two (the tuned
  tables' rows buckets, which the fused-MoE kernels pick tiles by) and to the whole budget;
- a decode batch of every size 1..16, every CUDA-graph bucket and the first size of every split count;
- the sampler's paths (greedy, temperature with top-k / top-p / min-p, seeded, logprobs, the logits edits:
  penalties, logit_bias, min_tokens) on mixed batches of every small row class (1, 8, 16, 17, 32, 33, 64)
  and the most rows: these write the lm_head's logits, where a greedy-only batch of up to 64 rows takes
  the argmax inside the lm_head;
- where the model has a tokenizer and xgrammar imports, grammar-masked decoding (the bitmask kernel, and
  the grammar compiler with the vocabulary, which a first structured request would otherwise build);
- a step that mixes decode rows with a prefill chunk;
- with EAGLE-3, the decode and mixed rounds again drafting at every depth the speculation policy may pick
  (pinned one by one), since a chain the policy shortens verifies outside the captured graphs.
The pooling runner, which never decodes, runs the prompt lengths and a full budget of prompts as embed
requests.
The prefix cache is off meanwhile, and afterwards the counters, the policy and random state are as they were
(the policy fresh); a Triton compile after the warm-up is logged as a warning naming the kernel.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import msgspec
import torch

from llmserve_core.engine.grammar import grammars_available
from llmserve_core.kernels import jit_count
from llmserve_core.kernels.jit_count import jit_compilations
from llmserve_proto import GuidedDecoding, PoolingParams, SamplingParams

log = logging.getLogger("llmserve.warmup")

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
MIXED = (GREEDY,
         SamplingParams(temperature=1.0, top_k=50, top_p=0.9, ignore_eos=True),
         SamplingParams(temperature=0.7, min_p=0.05, ignore_eos=True),
         SamplingParams(temperature=1.0, seed=1, ignore_eos=True),
         SamplingParams(temperature=0.0, logprobs=5, ignore_eos=True),
         SamplingParams(temperature=1.0, logprobs=0, speculative=False, ignore_eos=True),
         SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                        logit_bias={0: 1.0}, min_tokens=2, ignore_eos=True))
GUIDED = SamplingParams(temperature=0.0, guided=GuidedDecoding(kind="json_object"))


@dataclass(frozen=True)
class Round:
    """Requests started together and run to completion: `num_requests` prompts of `prompt_len` tokens,
    `new_tokens` each; mixed: cycle through the sampler's paths; late_prompt_len: one more prompt of
    that length arrives once the others decode (a step mixing decode rows and a prefill chunk); guided:
    every request decodes under a JSON grammar."""
    num_requests: int
    prompt_len: int
    new_tokens: int
    mixed: bool = False
    late_prompt_len: int = 0
    guided: bool = False
    pooling: bool = False           # embed requests (prompts only)


def prefill_lengths(budget: int, longest: int, chunked: bool) -> list[int]:
    tile_edges = [17, 31, 32, 33, 48, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1920, 1921, 2048]
    lengths = list(range(1, 17)) + tile_edges + [budget - 1, budget]
    if chunked:
        lengths.append(budget + 17)               # a second chunk: an extend over the first
    cap = longest if chunked else min(longest, budget)  # unchunked, a prompt must fit one step
    # Tuned tables pick their tiles by rows bucket, a power of two (kernels/fused_moe.py): a step in each
    # meets every variant they name (bucket_rounds' steps of several prompts, the buckets past the longest).
    lengths += [min(1 << i, cap) for i in range(budget.bit_length())]
    return sorted({n for n in lengths if 1 <= n <= cap})


def bucket_rounds(budget: int, cap: int, max_num_seqs: int, new_tokens: int) -> list[Round]:
    """Steps of every power of two of rows past the longest prompt (cap) up to the budget: as few prompts as
    reach it, each as long as keeps the step inside that power of two."""
    rounds = []
    for i in range(budget.bit_length()):
        rows = 1 << i
        n = -(-rows // cap)
        if rows > cap and n <= max_num_seqs:
            rounds.append(Round(n, rows // n, new_tokens))
    return rounds


def decode_sizes(max_num_seqs: int, buckets: list[int], num_kv_heads: int) -> list[int]:
    sizes = set(range(1, min(16, max_num_seqs) + 1)) | {b for b in buckets if b <= max_num_seqs} | {max_num_seqs}
    try:
        from llmserve_core.kernels.paged_decode import choose_num_splits
    except ImportError:                           # no Triton: no split-KV decode kernel to warm
        return sorted(sizes)
    seen = set()
    for n in range(1, max_num_seqs + 1):          # the first batch size of every split count
        splits = choose_num_splits(n, num_kv_heads)
        if splits not in seen:
            seen.add(splits)
            sizes.add(n)
    return sorted(sizes)


def small_row_classes(max_num_seqs: int) -> list[int]:
    """Row counts (as many as fit) that meet each variant of a small-M kernel once: Triton specializes an
    integer argument as 1, a multiple of 16 or anything else (xgrammar's bitmask kernel), and
    kernels/gemv.py picks a 16-, 32- or 64-row tile: 1, 8 and 16 rows, then 17 and 32, then 33 and 64."""
    return sorted({min(n, max_num_seqs) for n in (1, 8, 16, 17, 32, 33, 64)})


def warmup_plan(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, chunked: bool,
                buckets: list[int], num_kv_heads: int, lookahead: int = 0) -> list[Round]:
    # Room for the new tokens and the speculative lookahead past them.
    new_tokens = 3
    longest = max_model_len - new_tokens - lookahead
    budget = max_num_batched_tokens if chunked else min(max_num_batched_tokens, longest)
    rounds = [Round(1, n, new_tokens) for n in prefill_lengths(budget, longest, chunked)]
    fill = -(-budget // longest)                  # prompts that fill a whole token budget in one step
    if 1 < fill <= max_num_seqs:
        rounds.append(Round(fill, -(-budget // fill), new_tokens))
    # (unchunked, several prompts still share a step up to max_num_batched_tokens)
    rounds += bucket_rounds(max_num_batched_tokens, min(longest, budget), max_num_seqs, new_tokens)
    for n in decode_sizes(max_num_seqs, buckets, num_kv_heads):
        # Prompts of 2 tokens: n rows decode together after a short prefill of 2n tokens (if it fits).
        rounds.append(Round(n, 2, new_tokens))
    # The sampler's paths at each small row class (the lm_head writes logits for them, where a greedy-only
    # batch takes its argmax) and at the largest batch.
    for n in sorted(set(small_row_classes(max_num_seqs)) | {max_num_seqs}):
        rounds.append(Round(n, 2, new_tokens, mixed=True))
    late = min(budget // 2, longest - 5)        # the late round decodes 8 tokens, not 3
    if max_num_seqs > 1 and late > 1:
        rounds.append(Round(min(8, max_num_seqs - 1), 2, 8, late_prompt_len=late))
    return rounds


def pooling_plan(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, chunked: bool) -> list[Round]:
    """The pooling runner's rounds: every prompt length class, and a full token budget of prompts."""
    budget = max_num_batched_tokens if chunked else min(max_num_batched_tokens, max_model_len)
    rounds = [Round(1, n, 0, pooling=True) for n in prefill_lengths(budget, max_model_len, chunked)]
    fill = -(-budget // max_model_len)
    if 1 < fill <= max_num_seqs:
        rounds.append(Round(fill, -(-budget // fill), 0, pooling=True))
    return rounds


def draft_rounds(engine, plan: list[Round]) -> list[tuple[int, Round]]:
    """(depth, round) pairs that run the decode rounds' batch sizes, and the mixed round, drafting at every
    depth the speculation policy may pick: the full depth mostly replays captured graphs, but a chain the
    policy shortens verifies fewer rows per request outside them (a kernel variant per row count), and its
    first drafting step after plain steps only computes aux states. Each request decodes long enough to
    reach steady drafting steps."""
    new_tokens = 2 * (engine.spec.gamma + 2)
    sizes = [rnd for rnd in plan if rnd.prompt_len == 2 and not rnd.guided and not rnd.late_prompt_len]
    late = [rnd for rnd in plan if rnd.late_prompt_len]
    rounds = []
    for depth in sorted(engine.policy.widths):
        rounds += [(depth, Round(rnd.num_requests, 2, new_tokens, mixed=rnd.mixed)) for rnd in sizes]
        rounds += [(depth, Round(rnd.num_requests, 2, new_tokens, late_prompt_len=rnd.late_prompt_len)) for rnd in late]
    return rounds


def grammar_rounds(max_num_seqs: int) -> list[Round]:
    """Masked decode batches of each small row class: xgrammar's bitmask kernel specializes its row count."""
    return [Round(n, 2, 3, guided=True) for n in small_row_classes(max_num_seqs)]


def _run_round(engine, rnd: Round, r: random.Random, tag: int) -> None:
    vocab = engine.model_info.vocab_size

    def add(i: int, length: int, params: SamplingParams):
        prompt = [r.randrange(vocab) for _ in range(length)]
        if rnd.pooling:
            engine.add_pooling_request(f"__warmup-{tag}-{i}", prompt, PoolingParams())
        else:
            engine.add_request(f"__warmup-{tag}-{i}", prompt, msgspec.structs.replace(params, max_tokens=rnd.new_tokens))

    for i in range(rnd.num_requests):
        # (a mixed round of one request samples: plain greedy rows are the decode rounds')
        add(i, rnd.prompt_len, GUIDED if rnd.guided else MIXED[(i + 1) % len(MIXED)] if rnd.mixed else GREEDY)
    if rnd.guided:     # every rank of a tensor-parallel start-up must take the same steps: none before it compiles
        for i in range(rnd.num_requests):
            engine.requests[f"__warmup-{tag}-{i}"].grammar.future.exception()
    if rnd.late_prompt_len:
        for _ in range(3):                        # the short prompts are past their prefill: decoding
            engine.step()
        add(rnd.num_requests, rnd.late_prompt_len, GREEDY)
    while engine.has_unfinished():
        engine.step()


def warm_up(engine) -> dict:
    """Run the plan on `engine`, then put its counters, prefix cache setting and random state back."""
    t0 = time.perf_counter()
    jit_before = jit_compilations()
    runner, bm = engine.runner, engine.block_manager
    buckets = runner.graphs.buckets if runner.graphs is not None else []
    # A prompt must also fit the KV pool, which a small --num-kv-blocks makes shorter than max_model_len.
    longest = min(engine.max_model_len, bm.num_blocks * bm.block_size)
    cfg = engine.config
    if engine.runner_kind == "pooling":
        plan = pooling_plan(cfg.max_num_seqs, cfg.max_num_batched_tokens, longest, cfg.enable_chunked_prefill)
    else:
        plan = warmup_plan(cfg.max_num_seqs, cfg.max_num_batched_tokens, longest, cfg.enable_chunked_prefill,
                           buckets, engine.model_config.num_key_value_heads, engine.lookahead)
    if engine.runner_kind != "pooling" and grammars_available(cfg.tokenizer or cfg.model):
        plan += grammar_rounds(engine.config.max_num_seqs)
    drafting = draft_rounds(engine, plan) if engine.policy is not None else []
    caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False
    r = random.Random(0)
    try:
        for tag, rnd in enumerate(plan):
            _run_round(engine, rnd, r, tag)
        for tag, (depth, rnd) in enumerate(drafting, len(plan)):
            engine.policy.pinned = depth
            _run_round(engine, rnd, r, tag)
    finally:
        bm.enable_prefix_caching = caching
        if engine.policy is not None:
            engine.policy.pinned = None
    engine.reset_counters()
    torch.manual_seed(engine.config.seed)
    jit_count.warm_up_done()
    report = {"rounds": len(plan) + len(drafting), "seconds": time.perf_counter() - t0,
              "jit_compilations": jit_compilations() - jit_before}
    log.info("warm-up: %d rounds in %.1f s, %d kernels compiled", report["rounds"], report["seconds"],
             report["jit_compilations"])
    return report
