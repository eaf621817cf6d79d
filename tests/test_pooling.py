"""Pooling requests in the in-process engine against transformers, float32 on the CPU.

Embeddings equal transformers' Qwen3Model last-token hidden state (normalised, truncated first when asked)
and scores equal Qwen3ForCausalLM's last-position logits of the named tokens, whatever the scheduling:
chunked prefill with tiny budgets, prefix-cache hits, async scheduling, a pool small enough to preempt, and
generation requests in the same steps, whose greedy tokens stay transformers'. Then the runner's rules,
the KV pool a pooling runner sizes, and bad input naming its field while the engine serves on.
"""
import numpy as np
import pytest
import torch

from helpers.models import make_prompts
from helpers.pooling import hf_embeddings, hf_label_logits, make_embedding_model
from llmserve_core import Engine, EngineConfig
from llmserve_core.models.tiny import make_tiny_model
from llmserve_proto import PoolingParams, SamplingParams, ValidationError

CONFIGS = {
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "mha-tied-odd-headdim": dict(num_attention_heads=6, num_key_value_heads=6, head_dim=8, hidden_size=48,
                                 tie_word_embeddings=True),
}
SCHEDULES = {
    "plain": dict(),
    "chunked-tiny-budget": dict(max_num_batched_tokens=5, max_num_seqs=3),
    "async-chunked": dict(async_scheduling=True, max_num_batched_tokens=9),
    "preempting-pool": dict(num_kv_blocks=11, block_size=4, max_num_batched_tokens=16),
}
ATOL = 2e-6      # float32 rounding: the same sums in another order


def vectors(results) -> list[np.ndarray]:
    return [np.frombuffer(r.output.embedding, dtype="<f4") for r in results]


def assert_close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.asarray(w, dtype=np.float32), atol=ATOL, rtol=0)


@pytest.fixture(scope="module", params=list(CONFIGS))
def embedding_case(request, tmp_path_factory):
    path = make_embedding_model(tmp_path_factory.mktemp("embed"), seed=11, **CONFIGS[request.param])
    prompts = make_prompts(1024, seed=5) + [[7] * 40]        # shared prefixes, 1-token and block-long prompts
    return path, prompts, [v.numpy() for v in hf_embeddings(path, prompts)]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_embeddings_equal_transformers_qwen3model(embedding_case, schedule):
    path, prompts, expected = embedding_case
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", **SCHEDULES[schedule]))
    assert engine.runner_kind == "pooling" and engine.model_info.tasks == ("embed",)
    for attempt in range(2):      # the second pass starts from the prefix cache (each prompt's last token recomputed)
        results = engine.pool(prompts, PoolingParams())
        assert [r.finish_reason for r in results] == ["stop"] * len(prompts)
        assert_close(vectors(results), expected)
    assert max(r.num_cached_tokens for r in results) > 0
    stats = engine.stats()
    assert stats["used_kv_blocks"] == 0 and stats["running"] == 0 and stats["cached_kv_blocks"] > 0


def test_matryoshka_truncates_then_normalises(embedding_case):
    path, prompts, _ = embedding_case
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32"))
    for dims, normalize in ((8, True), (8, False), (None, False), (1, True)):
        results = engine.pool(prompts[:3], PoolingParams(dimensions=dims, normalize=normalize))
        want = hf_embeddings(path, prompts[:3], dimensions=dims, normalize=normalize)
        assert_close(vectors(results), [w.numpy() for w in want])
        if normalize:
            assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors(results))
    # One step holding requests of several kinds returns each its own (the rows are grouped by parameters).
    mixed = [PoolingParams(dimensions=4), PoolingParams(), PoolingParams(dimensions=4, normalize=False),
             PoolingParams(dimensions=16)]
    got = vectors(engine.pool(prompts[:4], mixed))
    for g, p, prompt in zip(got, mixed, prompts):
        assert_close([g], [hf_embeddings(path, [prompt], p.dimensions, p.normalize)[0].numpy()])


@pytest.fixture(scope="module")
def causal_lm(make_random_qwen3_dir):
    return make_random_qwen3_dir(seed=13, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 tie_word_embeddings=False)


def hf_greedy(path, prompts, max_new):
    from transformers import Qwen3ForCausalLM
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(max_new):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


@pytest.mark.parametrize("schedule", ["plain", "chunked-tiny-budget", "async-chunked"])
def test_scores_are_the_named_tokens_logits(causal_lm, schedule):
    prompts = make_prompts(1024, seed=9)
    labels = [17, 400, 3]
    engine = Engine(EngineConfig(model=causal_lm, device="cpu", dtype="float32", **SCHEDULES[schedule]))
    results = engine.pool(prompts, PoolingParams(task="score", token_ids=labels))
    want = hf_label_logits(causal_lm, prompts, labels)
    for r, w in zip(results, want):
        np.testing.assert_allclose(r.output.logits, w, atol=1e-5, rtol=0)
        assert r.output.embedding == b""


@pytest.mark.parametrize("schedule", ["plain", "chunked-tiny-budget", "async-chunked", "preempting-pool"])
def test_pooling_beside_generation_in_the_same_steps(causal_lm, schedule):
    """Generation requests and pooling requests (embed and score) share steps; the generated tokens stay
    transformers' greedy ones and every pooled answer is transformers' too."""
    prompts = make_prompts(1024, seed=21)
    gen, pooled = prompts[:3], prompts[3:] + prompts[:2]
    max_new = 6
    engine = Engine(EngineConfig(model=causal_lm, device="cpu", dtype="float32", **SCHEDULES[schedule]))
    params = [PoolingParams(), PoolingParams(task="score", token_ids=[5, 6])] * len(pooled)
    for i, p in enumerate(gen):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True))
    results = engine.pool(pooled, params[:len(pooled)])       # generation steps along meanwhile
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(len(gen))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[f"g{i}"] for i in range(len(gen))] == hf_greedy(causal_lm, gen, max_new)
    from transformers import Qwen3ForCausalLM
    hf = Qwen3ForCausalLM.from_pretrained(causal_lm, dtype=torch.float32).eval()
    with torch.no_grad():
        for r, p, pp in zip(results, pooled, params):
            if pp.task == "embed":
                h = hf.model(torch.tensor([p])).last_hidden_state[0, -1]
                assert_close(vectors([r]), [torch.nn.functional.normalize(h, dim=-1).numpy()])
            else:
                np.testing.assert_allclose(r.output.logits, hf(torch.tensor([p])).logits[0, -1, [5, 6]].tolist(),
                                           atol=1e-5)
    assert engine.stats()["used_kv_blocks"] == 0
    if schedule == "preempting-pool":      # the newest running requests give way: the pooling ones
        assert engine.stats()["num_preemptions"] > 0


def test_a_shared_instruction_prefix_is_computed_once(embedding_case):
    path, _, _ = embedding_case
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", block_size=8))
    instruction = list(range(100, 140))                  # five blocks every query shares
    queries = [instruction + [200 + i, 300 + i, 5] for i in range(6)]
    results = engine.pool(queries, PoolingParams())
    stats = engine.stats()
    # The first query computes the prefix, every later one finds its 40 tokens cached.
    assert stats["total_prompt_tokens"] == 43 + 5 * 3
    assert sorted(r.num_cached_tokens for r in results) == [0] + [40] * 5
    assert_close(vectors(results), [v.numpy() for v in hf_embeddings(path, queries)])


def test_abort_mid_prompt_frees_the_blocks(embedding_case):
    path, _, _ = embedding_case
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", max_num_batched_tokens=8))
    engine.add_pooling_request("long", list(range(1, 60)), PoolingParams())
    engine.step()
    assert engine.stats()["used_kv_blocks"] > 0
    engine.abort("long")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.pooled.embedding) for o in outs] == [("long", "abort", b"")]
    assert engine.stats()["used_kv_blocks"] == 0 and not engine.has_unfinished()


# ---------------------------------------------------------------- runners

def test_a_qwen3model_checkpoint_runs_the_pooling_runner_only(embedding_case):
    path, prompts, _ = embedding_case
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", max_model_len=256))
    assert engine.runner.graphs is None
    with pytest.raises(ValidationError) as e:
        engine.add_request("g", [1, 2, 3], SamplingParams(max_tokens=2))
    assert e.value.field == "task" and "pooling runner" in e.value.message
    with pytest.raises(ValidationError) as e:
        engine.add_pooling_request("s", [1, 2, 3], PoolingParams(task="score", token_ids=[1, 2]))
    assert e.value.field == "task" and "no lm_head" in e.value.message
    # A prompt may fill the whole context: nothing is generated after it.
    assert engine.pool([[3] * 256], PoolingParams())[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="runner"):
        Engine(EngineConfig(model=path, device="cpu", dtype="float32", runner="generate"))


def test_the_pooling_runner_holds_kv_for_prompts_in_flight_only(causal_lm):
    common = dict(model=causal_lm, device="cpu", dtype="float32", max_model_len=512, max_num_batched_tokens=64,
                  max_num_seqs=4, block_size=16, cpu_kv_cache_gib=1.0)
    generate, pooled = Engine(EngineConfig(**common)), Engine(EngineConfig(**common, runner="pooling"))
    # The longest prompt and two steps of chunks, each request's last block partly filled.
    assert pooled.block_manager.num_blocks == 512 // 16 + 2 * (64 // 16 + 4)
    assert generate.block_manager.num_blocks == 4 * 512 // 16 + 1
    assert pooled.model_info.tasks == ("embed", "score")        # a causal LM scores under the pooling runner
    with pytest.raises(ValidationError, match="pooling runner"):
        pooled.add_request("g", [1, 2], SamplingParams(max_tokens=1))
    want = hf_label_logits(causal_lm, [[4] * 500], [9])[0]
    np.testing.assert_allclose(pooled.pool([[4] * 500], PoolingParams(task="score", token_ids=[9]))[0].output.logits,
                               want, atol=1e-5)
    with pytest.raises(ValueError, match="runner"):
        EngineConfig(**common, runner="pooling", speculative_model=causal_lm).validate()
    with pytest.raises(ValueError, match="runner"):
        EngineConfig(**common, runner="pooling", speculative_method="ngram").validate()


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("field, prompt, params", [
    ("dimensions", [1, 2], PoolingParams(dimensions=0)),
    ("dimensions", [1, 2], PoolingParams(dimensions=65)),
    ("dimensions", [1, 2], PoolingParams(dimensions=2**63)),
    ("dimensions", [1, 2], PoolingParams(dimensions=-2**63)),
    ("dimensions", [1, 2], PoolingParams(dimensions=2.5)),
    ("token_ids", [1, 2], PoolingParams(task="score", token_ids=[2**64])),
    ("token_ids", [1, 2], PoolingParams(task="score", token_ids=[1024])),
    ("token_ids", [1, 2], PoolingParams(task="score", token_ids=[])),
    ("token_ids", [1, 2], PoolingParams(task="score", token_ids=list(range(17)))),
    ("token_ids", [1, 2], PoolingParams(token_ids=[3])),
    ("dimensions", [1, 2], PoolingParams(task="score", token_ids=[3], dimensions=4)),
    ("task", [1, 2], PoolingParams(task="classify")),
    ("task", [1, 2], PoolingParams(task="x" * 10_000)),
    ("normalize", [1, 2], PoolingParams(normalize=float("nan"))),
    ("prompt_token_ids", [], PoolingParams()),
    ("prompt_token_ids", [1, 2**63], PoolingParams()),
    ("prompt_token_ids", [-1], PoolingParams()),
    ("prompt_token_ids", [1] * 513, PoolingParams()),
    ("params", [1, 2], SamplingParams()),
])
def test_bad_pooling_requests_name_the_field_and_change_nothing(causal_lm, field, prompt, params):
    engine = _engine(causal_lm)
    with pytest.raises(ValidationError) as e:
        engine.add_pooling_request("bad", prompt, params)
    assert e.value.field == field
    assert not engine.has_unfinished()
    assert engine.pool([[1, 2, 3]], PoolingParams())[0].finish_reason == "stop"     # and it serves on


_ENGINES: dict = {}


def _engine(path):
    if path not in _ENGINES:
        _ENGINES[path] = Engine(EngineConfig(model=path, device="cpu", dtype="float32", max_model_len=512))
    return _ENGINES[path]


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_a_drafting_engine_serves_pooling_requests_with_plain_steps(causal_lm, tmp_path, method):
    from llmserve_core.models.tiny_draft import make_tiny_draft
    spec = (dict(speculative_model=make_tiny_draft(tmp_path / "draft", causal_lm, seed=2)) if method == "eagle3"
            else dict(speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=2))
    engine = Engine(EngineConfig(model=causal_lm, device="cpu", dtype="float32", speculative_policy="always", **spec))
    prompts = make_prompts(1024, seed=4)
    prompts[0] = prompts[0] * 3                  # repeats: prompt lookup finds drafts in them
    engine.add_request("g", prompts[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    results = engine.pool(prompts[1:], PoolingParams(task="score", token_ids=[8]))
    want = hf_label_logits(causal_lm, prompts[1:], [8])
    for r, w in zip(results, want):
        np.testing.assert_allclose(r.output.logits, w, atol=1e-5)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == hf_greedy(causal_lm, prompts[:1], 8)[0]
    assert engine.stats()["spec_num_steps"] > 0       # drafting resumed once the pooling requests ended


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pooling_matches_transformers_and_compiles_nothing_after_start_up(tmp_path):
    """On the GPU (bf16, the fast path's kernels): embeddings within bf16 rounding of transformers' float32
    ones (cosine), scores within a bf16 logit's, and after the start-up warm-up no kernel compiles for prompts
    of any length class, chunked or not, beside generation."""
    from helpers.models import MID
    embed_dir = make_embedding_model(tmp_path / "embed", seed=2, **MID)
    engine = Engine(EngineConfig(model=embed_dir, device="cuda", max_num_seqs=32, max_num_batched_tokens=256,
                                 max_model_len=1024))
    before = engine.stats()["jit_compilations"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 5, 17, 64, 65, 200, 700, 1024)]
    got = vectors(engine.pool(prompts, PoolingParams()))
    want = [w.numpy() for w in hf_embeddings(embed_dir, prompts)]
    assert min(float(np.dot(a, b)) for a, b in zip(got, want)) > 0.995
    got8 = vectors(engine.pool(prompts[:3], PoolingParams(dimensions=8)))
    assert all(v.shape == (8,) and abs(np.linalg.norm(v) - 1) < 1e-3 for v in got8)
    assert engine.stats()["jit_compilations"] == before, "a kernel compiled after start-up"
    del engine
    torch.cuda.empty_cache()
    causal = make_tiny_model(tmp_path / "causal", seed=2, **MID)
    engine = Engine(EngineConfig(model=causal, device="cuda", max_num_seqs=32, max_num_batched_tokens=256,
                                 max_model_len=1024))
    before = engine.stats()["jit_compilations"]
    engine.add_request("g", prompts[3], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    scores = engine.pool(prompts, PoolingParams(task="score", token_ids=[7, 300]))
    want = hf_label_logits(causal, prompts, [7, 300])
    for r, w in zip(scores, want):
        np.testing.assert_allclose(r.output.logits, w, atol=0.15, rtol=0.05)     # bf16 hidden states
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["jit_compilations"] == before, "a kernel compiled after start-up"
