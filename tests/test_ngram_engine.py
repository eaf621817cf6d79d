"""Prompt-lookup (ngram) speculation inside the engine (CPU, float32): greedy output equals plain decoding
with and without matches (requests with none verify zero drafts), through prefix hits, chunked prefill,
preemption, the step graphs' bookkeeping, async plain steps between drafting ones, an index still catching
up on a prompt, and opt-outs; sampling stays lossless; and a copy-heavy workload on the shipped trained
model accepts long runs."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from helpers.distribution import assert_matches_distribution, exact_distribution
from helpers.models import TRAINED_PAIR, held_out_prompts
from helpers.policies import ScriptedPolicy
from llmserve_core import Engine, EngineConfig
from llmserve_core.engine.spec import ngram as ngram_proposer
from llmserve_proto import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEPTH = 4
MAX_NEW = 14
SCHEDULES = {
    "plain": dict(block_size=8),                      # small blocks: the second pass hits the prefix cache
    "chunked": dict(max_num_batched_tokens=7, max_num_seqs=3, block_size=8),
    "preempting": dict(num_kv_blocks=26, block_size=4),
    "step-graphs": dict(max_num_seqs=5, block_size=8),    # buckets 1, 2, 4, 5: padded verify batches
    "async-switching": dict(async_scheduling=True, num_kv_blocks=26, block_size=4, speculative_policy="adaptive"),
    "index-catching-up": dict(block_size=8),          # a prompt indexed a few tokens a step
}


def ngram_engine(model, **kw) -> Engine:
    kw = dict(dict(device="cpu", dtype="float32", speculative_policy="always", speculative_gamma=DEPTH,
                   prompt_lookup_min=1, prompt_lookup_max=3), **kw)
    return Engine(EngineConfig(model=model, speculative_method="ngram", **kw))


def copying_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a run of themselves (matches), prompts that do not (none, until the output
    repeats), and two sharing a prefix."""
    rnd = random.Random(seed)
    run = [rnd.randrange(vocab) for _ in range(9)]
    shared = [rnd.randrange(vocab) for _ in range(12)]
    return [run + [rnd.randrange(vocab) for _ in range(5)] + run[:4],
            [rnd.randrange(vocab) for _ in range(3)] + run * 3,
            shared + [rnd.randrange(vocab)], shared + [rnd.randrange(vocab) for _ in range(7)],
            [rnd.randrange(vocab) for _ in range(30)], [rnd.randrange(vocab)]]


def greedy(n: int, opt_out_every: int = 0) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                           speculative=not (opt_out_every and i % opt_out_every == 1)) for i in range(n)]


def assert_all_blocks_free(engine: Engine) -> None:
    st = engine.stats()
    assert st["running"] == 0 and st["waiting"] == 0 and st["used_kv_blocks"] == 0
    engine.block_manager.check_invariants()


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32"))
    prompts = copying_prompts(engine.model_info.vocab_size, seed=5)
    return prompts, [c.token_ids for c in engine.generate(prompts, greedy(len(prompts)))]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_output_equals_plain_decoding(tiny_model_dir, plain, monkeypatch, schedule):
    prompts, want = plain
    if schedule == "step-graphs":
        monkeypatch.setenv("LLMSERVE_CPU_STEP_GRAPHS", "1")
    if schedule == "index-catching-up":
        monkeypatch.setattr(ngram_proposer, "INDEX_BUDGET", 3 * 3)        # 3 tokens a step at 3 n-gram lengths
        monkeypatch.setattr(ngram_proposer, "STEADY", 2)
    engine = ngram_engine(tiny_model_dir, **SCHEDULES[schedule])
    if schedule == "async-switching":
        engine.policy = ScriptedPolicy(engine.spec.policy_widths(), seed=3)
    for opt_out in (0, 3):          # the second pass hits the prefix cache and mixes in opted-out requests
        got = engine.generate(prompts, greedy(len(prompts), opt_out))
        assert [c.token_ids for c in got] == want
    st = engine.stats()
    # Some request-steps found a match and some did not (zero drafts, verified all the same).
    assert 0 < st["spec_num_draft_tokens"] < DEPTH * st["spec_num_steps"], st
    assert st["spec_num_accepted_tokens"] > 0
    if schedule == "plain":
        assert st["prefix_hits"] > 0
    if schedule in ("preempting", "async-switching"):
        assert st["num_preemptions"] > 0
    if schedule == "step-graphs":
        assert engine.spec.graphs["verify"].replays > 0 and not engine.spec.proposer.graphs
    if schedule == "async-switching":
        assert st["spec_num_plain_steps"] > 0 and st["spec_num_drafted_steps"] > 0
    assert_all_blocks_free(engine)


def test_an_index_catching_up_proposes_nothing_until_it_has(tiny_model_dir, monkeypatch):
    """A request whose prompt is still being indexed (a few tokens a step here) drafts nothing: its first
    drafting steps verify zero drafts, and its index ends up where the tokens are."""
    monkeypatch.setattr(ngram_proposer, "INDEX_BUDGET", 3 * 4)
    monkeypatch.setattr(ngram_proposer, "STEADY", 1)
    engine = ngram_engine(tiny_model_dir)
    prompt = list(range(3, 40)) * 2
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    lengths = []
    while engine.has_unfinished():
        req = engine.requests.get("r")
        engine.step()
        if req is not None and req.spec_state is not None:
            lengths.append(req.spec_state.length)
    assert lengths[0] < len(prompt) and lengths == sorted(lengths)


def test_policy_prices_an_ngram_step_from_its_own_prior(tiny_model_dir):
    engine = ngram_engine(tiny_model_dir, speculative_policy="adaptive")
    assert engine.policy.prior_cost_per_draft == ngram_proposer.NgramProposer.prior_cost_per_draft
    assert engine.spec.proposer.describe() == "prompt lookup (n-grams of 1 to 3 tokens)"
    assert engine.lookahead == DEPTH and not engine.block_manager.recompute_last_hit_block


def test_a_workload_without_copies_turns_drafting_off(tiny_model_dir):
    """Sampled at a high temperature, the tiny model's tokens hardly ever repeat an earlier run: the
    adaptive policy measures the few matches and their rejections and settles on plain steps."""
    engine = ngram_engine(tiny_model_dir, speculative_policy="adaptive", prompt_lookup_min=3, prompt_lookup_max=3)
    vocab = engine.model_info.vocab_size
    rnd = random.Random(0)
    prompts = [[rnd.randrange(vocab) for _ in range(20)] for _ in range(8)]
    engine.generate(prompts, SamplingParams(max_tokens=48, temperature=1.5, ignore_eos=True, seed=1))
    st = engine.stats()
    assert st["spec_num_plain_steps"] > 3 * st["spec_num_drafted_steps"], st
    assert st["spec_policy_expected_length"] < 1.5


# ---- sampling ----------------------------------------------------------------------------------------------

def test_sampling_matches_the_target_distribution():
    """The first token comes from the prefill's plain sample; the next two are verified against drafts copied
    from the prompt, so rejection sampling with a one-hot proposal decides them: the joint frequencies over
    many unseeded requests must match the target's exact distribution. The prompt holds the model's own
    continuation of its start, then the start again: the first token mostly matches there (the most likely
    one always does), and the drafts after it are sometimes right."""
    from transformers import Qwen3ForCausalLM
    target = str(TRAINED_PAIR / "target")
    hf = Qwen3ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    start = held_out_prompts(5, length=8)[4]
    solo = Engine(EngineConfig(model=target, device="cpu", dtype="float32"))
    prompt = start + solo.generate([start], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids + start
    top_k, n = 3, 1500
    expected = exact_distribution(hf, prompt, top_k, 3)
    engine = ngram_engine(target, max_num_seqs=256, speculative_gamma=2, prompt_lookup_max=2)
    torch.manual_seed(0)
    got = engine.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True))
    assert_matches_distribution([c.token_ids for c in got], expected)
    st = engine.stats()
    assert 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    assert_all_blocks_free(engine)


def test_a_seeded_request_gives_its_plain_tokens():
    target = str(TRAINED_PAIR / "target")
    prompts = held_out_prompts(4, length=12)
    params = [SamplingParams(max_tokens=24, temperature=t, top_k=k, seed=s, ignore_eos=True)
              for t, k, s in ((1.0, 0, 7), (0.7, 20, 2 ** 63 - 1), (1.3, 5, 0), (0.9, 0, 3))]
    solo = Engine(EngineConfig(model=target, device="cpu", dtype="float32"))
    want = [solo.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    busy = ngram_engine(target, num_kv_blocks=14, block_size=4)
    got = busy.generate(prompts, params)
    assert [c.token_ids for c in got] == want
    assert busy.stats()["spec_num_draft_tokens"] > 0 and busy.stats()["num_preemptions"] > 0


# ---- a copy-heavy workload ------------------------------------------------------------------------------------

def test_a_copy_heavy_workload_accepts_long_runs():
    """benchmarks/ngram_cpu.py's workload (each prompt holds an edited text the answer retells) on the
    shipped trained model: the plain engine's tokens, with several tokens a step on average."""
    spec = importlib.util.spec_from_file_location("ngram_cpu", ROOT / "benchmarks/ngram_cpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    plain = bench.make_engine(None)
    prompts = bench.copy_heavy_prompts(plain, 6)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    engine = bench.make_engine("k5-2..4")
    assert [c.token_ids for c in engine.generate(prompts, params)] == want
    st = engine.stats()
    print(f"copy-heavy: mean acceptance length {st['spec_mean_acceptance_length']:.2f}, "
          f"acceptance rate {st['spec_acceptance_rate']:.2f}")
    assert st["spec_mean_acceptance_length"] > 1.8, st
    assert_all_blocks_free(engine)


# ---- the GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_verify_graphs_and_async_steps_give_plain_tokens(tiny_model_dir, plain):
    """On the GPU (Triton attention, float32): the verify graph's padded rows (requests with and without a
    match in one graph), async plain steps between drafting ones, and eager steps all give the plain
    engine's greedy tokens."""
    prompts, _ = plain
    cuda = dict(device="cuda", dtype="float32", attention_backend="triton")
    reference = Engine(EngineConfig(model=tiny_model_dir, enforce_eager=True, **cuda))
    want = [c.token_ids for c in reference.generate(prompts, greedy(len(prompts)))]
    for eager in (True, False):
        engine = ngram_engine(tiny_model_dir, **cuda, enforce_eager=eager,
                              max_num_seqs=8, speculative_policy="adaptive")
        engine.policy = ScriptedPolicy(engine.spec.policy_widths(), seed=2, plain_share=0.3)
        assert [c.token_ids for c in engine.generate(prompts, greedy(len(prompts)))] == want
        st = engine.stats()
        assert 0 < st["spec_num_draft_tokens"] < DEPTH * st["spec_num_steps"] and st["spec_num_plain_steps"] > 0
        if not eager:
            assert engine.spec.graphs["verify"].capture and engine.spec.graphs["verify"].replays > 0
        assert_all_blocks_free(engine)
