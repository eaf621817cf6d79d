"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' Qwen3ForCausalLM, float32 on CPU:
every prompt position's log-softmax, whatever the scheduling (chunks, preemption, async steps, a prefix
cache holding the prompt, a draft model speculating)."""
import random

import pytest
import torch

from llmserve_core import Engine, EngineConfig
from llmserve_core.models.tiny_draft import make_tiny_draft
from llmserve_proto import SamplingParams, ValidationError

K = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import Qwen3ForCausalLM
    hf = Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rnd = random.Random(5)
    vocab = hf.config.vocab_size
    shared = [rnd.randrange(vocab) for _ in range(20)]
    prompts = [[rnd.randrange(vocab)], shared + [rnd.randrange(vocab) for _ in range(3)],
               [rnd.randrange(vocab) for _ in range(9)], shared + [rnd.randrange(vocab) for _ in range(17)]]
    with torch.no_grad():
        logps = [hf(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]
    return prompts, logps


def assert_matches(prompt, logp, got, k=K):
    """got: one TokenLogprobs per prompt token after the first; logp: the reference's [len, vocab]."""
    assert len(got) == len(prompt) - 1
    for pos, lp in enumerate(got, start=1):
        row = logp[pos - 1]
        assert abs(lp.logprob - row[prompt[pos]].item()) < TOL, pos
        assert len(lp.top) == k
        values, ids = row.topk(k + 1)
        for j, (tid, value) in enumerate(lp.top):
            assert abs(value - values[j].item()) < TOL
            tied = any(abs(values[j] - values[i]) < TOL for i in (j - 1, j + 1) if 0 <= i <= k)
            assert tied or tid == ids[j].item(), (pos, j)


SCHEDULES = {
    "plain": dict(),
    # 7 tokens a step over 3 sequences: prompts arrive in several chunks, each scored 3 rows at a time.
    "chunked": dict(max_num_batched_tokens=7, max_num_seqs=3),
    "async-chunked-preempting": dict(async_scheduling=True, num_kv_blocks=14, block_size=4,
                                     max_num_batched_tokens=7),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_prompt_logprobs_match_transformers(tiny_model_dir, reference, schedule):
    prompts, logps = reference
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", **SCHEDULES[schedule]))
    # Temperature and penalties do not touch them (the model's own distribution, as vLLM reports).
    params = [SamplingParams(max_tokens=6, temperature=t, prompt_logprobs=K, ignore_eos=True, repetition_penalty=r)
              for t, r in ((0.0, 1.0), (0.7, 1.3), (1.0, 1.0), (0.0, 1.0))]
    got = engine.generate(prompts, params)
    for prompt, logp, c in zip(prompts, logps, got):
        assert_matches(prompt, logp, c.prompt_logprobs)
    if "preempting" in schedule:
        assert engine.stats()["num_preemptions"] > 0


def test_a_prefix_cache_hit_still_scores_every_position(tiny_model_dir, reference):
    prompts, logps = reference
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", block_size=4,
                                 max_num_batched_tokens=8))
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = engine.generate([prompts[3]], greedy)[0]
    assert engine.generate([prompts[3]], greedy)[0].num_cached_tokens > 0      # the cache holds the prompt
    got = engine.generate([prompts[3], prompts[1]], SamplingParams(max_tokens=3, temperature=0.0,
                                                                   ignore_eos=True, prompt_logprobs=0))
    for c, i in zip(got, (3, 1)):
        assert c.num_cached_tokens == 0
        assert_matches(prompts[i], logps[i], c.prompt_logprobs, k=0)
    assert got[0].token_ids == first.token_ids
    # Asking for none, the same prompt hits the cache again.
    assert engine.generate([prompts[3]], greedy)[0].num_cached_tokens > 0


def test_only_the_first_output_carries_them(tiny_model_dir, reference):
    prompts, _ = reference
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", max_num_batched_tokens=8))
    engine.add_request("r", prompts[3], SamplingParams(max_tokens=4, prompt_logprobs=1, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.new_token_ids or o.finish_reason]
    assert len(outs[0].prompt_logprobs) == len(prompts[3]) - 1 and outs[0].new_token_ids
    assert all(o.prompt_logprobs is None for o in outs[1:])


@pytest.mark.parametrize("value", [-1, 21, 2**40, True, 1.5, "3"])
def test_bad_values_are_refused_by_name(tiny_model_dir, value):
    with pytest.raises(ValidationError) as e:
        SamplingParams(prompt_logprobs=value).validate()
    assert e.value.field == "prompt_logprobs"


def test_a_speculating_engine_scores_prompts_with_the_target(tiny_model_dir, reference, tmp_path):
    prompts, logps = reference
    draft = make_tiny_draft(tmp_path / "draft", tiny_model_dir, seed=1)
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", speculative_model=draft,
                                 speculative_gamma=3, speculative_policy="always", max_num_batched_tokens=7,
                                 max_num_seqs=3))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = engine.generate(prompts, greedy)
    # A request decoding (and drafting) while the others' prompts go through the drafting steps in chunks.
    got = engine.generate([prompts[2]] + prompts, [greedy] + [SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=K)] * len(prompts))
    for prompt, logp, c, w in zip(prompts, logps, got[1:], want):
        assert_matches(prompt, logp, c.prompt_logprobs)
        assert c.token_ids == w.token_ids
    assert engine.stats()["spec_num_steps"] > 0
