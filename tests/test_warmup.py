"""The start-up warm-up: which shapes it runs, that it leaves no trace in what the engine serves or
reports, and the JIT-compilation counter it is checked with."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from llmserve_core import Engine, EngineConfig
from llmserve_core.engine.step_graphs import batch_buckets
from llmserve_core.engine.warmup import decode_sizes, grammar_rounds, pooling_plan, prefill_lengths, warmup_plan
from llmserve_core.kernels.fused_moe import rows_bucket
from llmserve_core.kernels import jit_count
from llmserve_core.kernels.paged_decode import choose_num_splits
from llmserve_core.models.tiny_draft import make_tiny_draft
from llmserve_proto import GuidedDecoding, PoolingParams, SamplingParams


def test_plan_covers_small_rows_tile_edges_every_bucket_and_split_count():
    buckets = batch_buckets(256)
    plan = warmup_plan(256, 8192, 4096, True, buckets, 8)
    single = {r.prompt_len for r in plan if r.num_requests == 1 and not r.mixed}
    assert set(range(1, 17)) <= single                           # every small row count
    assert {64, 65, 128, 129, 1921, 2048} <= single               # tile edges
    # every rows bucket of the MoE kernels' tables up to the longest prompt (the fill round holds the budget's)
    assert {1 << i for i in range(13)} <= {rows_bucket(n) for n in single}
    assert any(r.num_requests > 1 and r.num_requests * r.prompt_len >= 8192 for r in plan)  # fills a step
    longer = warmup_plan(8, 2048, 16384, True, [], 8)
    assert {2048, 2048 + 17} <= {r.prompt_len for r in longer}    # a whole budget, then an extend over it
    sizes = {r.num_requests for r in plan if r.prompt_len == 2 and not r.mixed and not r.late_prompt_len}
    assert set(range(1, 17)) | set(buckets) <= sizes
    assert {choose_num_splits(n, 8) for n in sizes} == {choose_num_splits(n, 8) for n in range(1, 257)}
    assert {r.num_requests for r in plan if r.mixed} == {1, 8, 16, 17, 32, 33, 64, 256}   # the logits path's row classes
    assert any(r.late_prompt_len for r in plan)
    for r in plan:                                               # every round fits the model and the pool
        assert max(r.prompt_len, r.late_prompt_len) + r.new_tokens <= 4096 and 1 <= r.num_requests <= 256


def test_plan_respects_short_models_lookahead_and_unchunked_budgets():
    plan = warmup_plan(4, 64, 100, False, [], 2, lookahead=4)
    assert max(max(r.prompt_len, r.late_prompt_len) + r.new_tokens + 4 for r in plan) <= 100
    assert max(prefill_lengths(64, 93, chunked=False)) == 64      # no extend round without chunking
    assert decode_sizes(3, [1, 2, 3], 8) == [1, 2, 3]
    # A 37-token prompt at most, a 256-token budget: several prompts fill a step to each rows bucket past 37.
    short = warmup_plan(8, 256, 40, True, [], 2)
    prefills = {rows_bucket(r.num_requests * r.prompt_len) for r in short}
    assert prefills >= {1 << i for i in range(9)} and max(r.prompt_len + r.new_tokens for r in short) <= 40


def generate(engine, prompts):
    greedy = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    sampled = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=1.0, top_k=20, ignore_eos=True))
    return [c.token_ids for c in greedy + sampled]


@pytest.fixture(scope="module")
def tiny_draft(tiny_model_dir, tmp_path_factory):
    return make_tiny_draft(tmp_path_factory.mktemp("draft"), tiny_model_dir, seed=1)


@pytest.mark.parametrize("speculative", [False, True])
def test_warmed_engine_serves_and_reports_as_a_cold_one(tiny_model_dir, tiny_draft, speculative):
    # The adaptive policy picks draft depths from measured step times, so on a busy machine two engines
    # may draft differently and unseeded samples draw differently: "always" keeps the draws comparable.
    cfg = dict(model=tiny_model_dir, device="cpu", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
               num_kv_blocks=64, speculative_model=tiny_draft if speculative else None,
               speculative_policy="always")
    warm = Engine(EngineConfig(**cfg, warmup=True))
    assert warm.warmup_report["rounds"] > 30
    s = warm.stats()
    assert s["num_steps"] == s["total_prompt_tokens"] == s["total_generated_tokens"] == 0
    assert s["prefix_queries"] == s["prefix_hits"] == s["num_preemptions"] == 0
    assert s["free_kv_blocks"] == s["total_kv_blocks"] and s["cached_kv_blocks"] == 0
    assert s.get("spec_num_steps", 0) == 0 and not warm.requests
    # The grammar rounds ran (the tiny model has a tokenizer): the compiler is built, the counters are zero.
    assert warm.grammars is not None and warm.grammars._compiler is not None
    assert warm.grammars.stats() == {"grammars_compiled": 0, "grammar_cache_hits": 0}
    prompts = [[5, 9, 2, 7] * 5, [100, 3], list(range(30, 90))]
    served = generate(warm, prompts)          # before the next engine re-seeds the process's generator
    cold = Engine(EngineConfig(**cfg))
    assert cold.warmup_report is None                           # off by default on the CPU
    assert served == generate(cold, prompts)                    # greedy and sampled alike
    assert warm.stats()["prefix_hit_rate"] == cold.stats()["prefix_hit_rate"]


def test_warm_up_drafts_at_every_depth_the_policy_may_pick(tiny_model_dir, tiny_draft, monkeypatch):
    """A chain the adaptive policy shortens verifies fewer rows per request, outside the captured graphs:
    the warm-up drafts at every depth, at the smallest and largest batch, in a step beside a prefill
    chunk too; then the policy starts from its priors, unpinned."""
    from llmserve_core.engine.spec.executor import SpecExecutor
    seen = set()
    execute = SpecExecutor.execute

    def recording(self, sched, gamma=None):
        seen.add((len(sched.requests), gamma, any(r.is_prefilling for r in sched.requests)))
        return execute(self, sched, gamma)
    monkeypatch.setattr(SpecExecutor, "execute", recording)
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                                 max_model_len=128, num_kv_blocks=64, speculative_model=tiny_draft,
                                 speculative_gamma=3, speculative_policy="adaptive", warmup=True))
    for depth in (1, 2, 3):
        assert {(1, depth, False), (4, depth, False)} <= seen, (depth, sorted(seen))
        assert any(g == depth and mixed for _, g, mixed in seen), depth
    p = engine.policy
    assert p.pinned is None and p.num_drafted_steps == p.num_plain_steps == 0
    assert engine.step_costs.step_seconds(1, 1) is None                    # no warm-up timings kept
    assert engine.generate([[5, 9, 2]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids


def test_a_compile_after_the_warm_up_is_logged_by_name(monkeypatch, caplog):
    monkeypatch.setattr(jit_count, "_serving", False)
    hook = jit_count._count(None)
    with caplog.at_level("WARNING", logger="llmserve.jit"):
        hook(key="warm", fn=type("F", (), {"name": "_decode_kernel"})())
        assert not caplog.records
        jit_count.warm_up_done()
        hook(key="ROWS=3", fn=type("F", (), {"name": "_decode_kernel"})())
    assert "_decode_kernel" in caplog.text and "ROWS=3" in caplog.text


def test_warm_up_fits_a_pool_smaller_than_max_model_len(tiny_model_dir):
    # 4 blocks of 16 tokens hold 64 positions, half of max_model_len: no warm-up prompt may need more.
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                                 max_model_len=128, num_kv_blocks=4, block_size=16, warmup=True))
    assert engine.warmup_report["rounds"] > 10 and not engine.requests
    assert engine.generate([[5, 9, 2]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids


def test_the_pooling_runner_warms_up_on_prompts_alone(tmp_path):
    """An embedding model's engine runs every prompt length class (up to the whole context: nothing follows a
    pooling prompt) and a full budget of prompts as embed requests, then reports as a cold one."""
    from helpers.pooling import make_embedding_model
    model = make_embedding_model(tmp_path / "embed", seed=1)
    plan = pooling_plan(4, 64, 128, True)
    assert [r.prompt_len for r in plan if r.num_requests == 1] == prefill_lengths(64, 128, True)
    assert all(r.pooling and r.new_tokens == 0 for r in plan) and plan[-1].num_requests * plan[-1].prompt_len >= 64
    engine = Engine(EngineConfig(model=model, device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                                 max_model_len=128, warmup=True))
    assert engine.warmup_report["rounds"] == len(plan) and not engine.requests
    stats = engine.stats()
    assert stats["total_prompt_tokens"] == 0 and stats["used_kv_blocks"] == 0 and stats["cached_kv_blocks"] == 0
    assert engine.pool([[5, 9, 2]], PoolingParams())[0].finish_reason == "stop"


def test_jit_counter_chains_the_hook_it_finds(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw) or None)
    monkeypatch.setattr(jit_count, "_installed", False)
    before = jit_count.jit_compilations()
    jit_count.install()
    jit_count.install()                                         # idempotent: one counter, not two
    knobs.runtime.jit_post_compile_hook(key="k", repr="r")
    assert jit_count.jit_compilations() == before + 1 and seen == [{"key": "k", "repr": "r"}]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_nothing_compiles_after_start_up(fp8, make_random_qwen3_dir):
    """A varied workload (lengths, batch sizes, sampler paths, chunked prompts) after the warm-up adds no
    Triton or FA4 kernel, with bf16 weights and cache or FP8 ones (the FP8 GEMVs, gate_up's ending in the
    SiLU-and-mul among them). max_num_seqs is 32, so 16 sampled rows (the lm_head writing logits for a
    16-row tile) are not also the largest batch the warm-up runs; one lone request samples."""
    model = make_random_qwen3_dir(seed=3, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                  tie_word_embeddings=False)
    engine = Engine(EngineConfig(model=model, device="cuda", max_num_seqs=32, max_num_batched_tokens=256,
                                 max_model_len=1024, num_kv_blocks=512, quantization="fp8" if fp8 else None,
                                 kv_cache_dtype="fp8_e4m3" if fp8 else "auto"))
    before = engine.stats()["jit_compilations"]
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=40, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=14, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=0.9, presence_penalty=1.0, repetition_penalty=1.3,
                             logit_bias={7: 3.0}, min_tokens=4, ignore_eos=True)]
    if importlib.util.find_spec("xgrammar") is not None:      # a bare GPU machine may lack it
        params.append(SamplingParams(max_tokens=12, temperature=0.0,
                                     guided=GuidedDecoding(kind="json", spec='{"type": "object"}')))
    for k, (n, lengths) in enumerate(((1, [1]), (1, [700]), (3, [5, 17, 300]),
                                      (16, [2, 33, 64, 65, 129] * 3 + [900]), (7, [250] * 7))):
        prompts = [torch.randint(0, 1000, (L,), generator=g).tolist() for L in lengths[:n]]
        engine.generate(prompts, [params[(i + k) % len(params)] for i in range(len(prompts))])
    assert engine.stats()["jit_compilations"] == before, "a kernel compiled after start-up"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_nothing_compiles_after_start_up_while_drafting(make_random_qwen3_dir, tmp_path):
    """Drafting at each depth the policy may pick, beside prefill chunks and alone, adds no kernel after
    the warm-up."""
    model = make_random_qwen3_dir(seed=4, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                  tie_word_embeddings=False)
    draft = make_tiny_draft(tmp_path / "draft", model, seed=2)
    engine = Engine(EngineConfig(model=model, device="cuda", max_num_seqs=16, max_num_batched_tokens=256,
                                 max_model_len=1024, num_kv_blocks=512, speculative_model=draft,
                                 speculative_gamma=3, speculative_policy="adaptive"))
    before = engine.stats()["jit_compilations"]
    g = torch.Generator().manual_seed(1)
    for depth in (1, 2, 3, None):
        engine.policy.pinned = depth
        # Alone, a 23- or 29-token prompt's prefill and the draft's catch-up over it have row counts no
        # warm-up runs: they must not take a kernel that specializes on the row count.
        for lengths in ([3], [23], [29], [40, 300, 7], [2] * 9 + [500]):
            prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
            engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert engine.stats()["jit_compilations"] == before, "a kernel compiled after start-up"


def test_grammar_rounds_meet_each_row_count_class_of_the_mask_kernel():
    assert [r.num_requests for r in grammar_rounds(256)] == [1, 8, 16, 17, 32, 33, 64]
    assert [r.num_requests for r in grammar_rounds(4)] == [1, 4]
    assert all(r.guided for r in grammar_rounds(256))
