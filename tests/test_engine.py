"""The in-process Engine against transformers' own Qwen3ForCausalLM, float32 on CPU.

Greedy outputs must be token-exact whatever the scheduling: prefix caching on or off, chunked prefill
with tiny budgets, a KV pool small enough to force preemption, each request alone or in a batch.
"""
import pytest
import torch

from helpers.engine import SCHEDULES, assert_all_blocks_free, hf_greedy
from helpers.models import make_prompts
from llmserve_core import Engine, EngineConfig
from llmserve_core.models.config import ModelConfig
from llmserve_proto import SamplingParams, ValidationError

CONFIGS = {
    # name: (heads, kv heads, head_dim, tied embeddings)
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
    "gqa2-untied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "gqa4-odd-headdim": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
}

@pytest.fixture(scope="module", params=list(CONFIGS))
def model_case(request, make_random_qwen3_dir):
    path = make_random_qwen3_dir(seed=7, **CONFIGS[request.param])
    from transformers import Qwen3ForCausalLM
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size, seed=1)
    max_new = 10
    expected = [hf_greedy(hf, p, max_new) for p in prompts]
    return path, prompts, expected, max_new


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_matches_transformers(model_case, schedule, monkeypatch):
    path, prompts, expected, max_new = model_case
    cfg = dict(SCHEDULES[schedule])
    if cfg.pop("step_graphs", False):
        monkeypatch.setenv("LLMSERVE_CPU_STEP_GRAPHS", "1")
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", **cfg))
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    # Twice: the second pass hits the prefix cache where it is on.
    for _ in range(2):
        got = engine.generate(prompts, params)
        assert [c.token_ids for c in got] == expected
        assert all(c.finish_reason == "length" for c in got)
    if "preempting" in schedule:
        assert engine.stats()["num_preemptions"] > 0
    if "graphs" in schedule:
        assert engine.runner.graphs.replays > 0 and engine.runner.graphs._loads == engine.runner.graphs.replays
    if schedule == "plain":
        assert engine.stats()["prefix_hit_rate"] > 0
    assert_all_blocks_free(engine)


def test_alone_equals_batched(model_case):
    path, prompts, expected, max_new = model_case
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", enable_prefix_caching=False))
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    assert alone == expected


# ---- stopping --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=256))


def test_stop_token_ids_and_eos(engine):
    prompt = [5, 6, 7, 8]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    got = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert got.finish_reason == "stop" and got.token_ids == free_run.token_ids[:first + 1]
    assert engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eos_stops_unless_ignored(tiny_model_dir, async_scheduling):
    eng = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=256,
                              async_scheduling=async_scheduling))
    prompt = [5, 6, 7, 8]
    free_run = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    # Make the 3rd generated token an eos id for this engine and check it stops there.
    eng.model_info = eng.model_info.__class__(**{**eng.model_info.__dict__, "eos_token_ids": (free_run.token_ids[2],)})
    got = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    first = free_run.token_ids.index(free_run.token_ids[2])
    assert got.finish_reason == "stop" and got.token_ids == free_run.token_ids[:first + 1]
    ignored = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert ignored.token_ids == free_run.token_ids and ignored.finish_reason == "length"


def test_max_model_len_stops(tiny_model_dir):
    eng = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=12))
    got = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0]
    assert len(got.token_ids) == 7 and got.finish_reason == "length"


@pytest.mark.parametrize("value", [0, -5, 1])
def test_max_model_len_below_two_is_refused(value):
    # 0 used to mean "the model's length" and a negative length built an engine that refused every request.
    with pytest.raises(ValueError, match="max_model_len: must be >= 2"):
        EngineConfig(model="x", max_model_len=value).validate()


def test_yarn_serves_factor_times_the_original_context(make_random_qwen3_dir):
    """Qwen3's long-context recipe adds rope_scaling yarn (factor 4 over original_max_position_embeddings
    32768) to a config.json that keeps max_position_embeddings 40960, and serves 131072 tokens. Scaled
    down here (40 / 32 -> 128): the engine serves past max_position_embeddings, token-exact."""
    path = make_random_qwen3_dir(seed=7, max_position_embeddings=40, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32"))
    assert engine.max_model_len == 128
    from transformers import Qwen3ForCausalLM
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = make_prompts(hf.config.vocab_size, seed=2)[5][:30] * 2        # 60 tokens, past 40
    got = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == hf_greedy(hf, prompt, 12)
    with pytest.raises(ValueError, match="max_model_len: 129 exceeds the model's 128 positions"):
        Engine(EngineConfig(model=path, device="cpu", dtype="float32", max_model_len=129))


# ---- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,prompt,kwargs", [
    ("prompt_token_ids", [], {}),
    ("prompt_token_ids", [1, 10**9], {}),
    ("prompt_token_ids", [1, -1], {}),
    ("prompt_token_ids", [1] * 256, {}),
    ("max_tokens", [1] * 250, dict(max_tokens=10)),
    ("max_tokens", [1], dict(max_tokens=0)),
    ("temperature", [1], dict(temperature=-0.5)),
    ("top_p", [1], dict(top_p=0.0)),
    ("top_p", [1], dict(top_p=1.5)),
    ("top_k", [1], dict(top_k=-2)),
    ("min_p", [1], dict(min_p=2.0)),
    ("logprobs", [1], dict(logprobs=999)),
])
def test_bad_requests_name_the_field_and_change_nothing(engine, field, prompt, kwargs):
    before = engine.stats()
    with pytest.raises(ValidationError) as e:
        engine.add_request("bad", prompt, SamplingParams(**kwargs))
    assert e.value.field == field
    assert engine.stats() == before and "bad" not in engine.requests


def test_duplicate_id_and_unknown_abort(engine):
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValidationError) as e:
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    assert e.value.field == "request_id"
    engine.abort("no-such-request")
    engine.abort("dup")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("dup", "abort")]
    assert_all_blocks_free(engine)


def test_generate_keeps_the_outputs_of_requests_it_did_not_add(engine):
    """generate() steps the whole engine: a request queued through add_request() that makes progress (or
    ends) meanwhile still reports every token and its finish from the caller's next step()."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    alone = engine.generate([[1, 2, 3]], params)[0].token_ids
    engine.add_request("queued", [1, 2, 3], params)
    engine.generate([[4, 5, 6]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tokens, finish = [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "queued" and finish is None
            tokens += out.new_token_ids
            finish = out.finish_reason
    assert tokens == alone and finish == "length"
    assert_all_blocks_free(engine)


def test_abort_mid_generation_frees_blocks(engine):
    engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(2, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats()["used_kv_blocks"] > 0
    engine.abort("a")
    engine.abort("b")
    engine.step()
    assert_all_blocks_free(engine)


def test_stats_fields(engine):
    st = engine.stats()
    for key in ("running", "waiting", "free_kv_blocks", "cached_kv_blocks", "used_kv_blocks", "total_kv_blocks",
                "kv_usage", "prefix_hit_rate", "num_tokens_scheduled"):
        assert key in st
    assert st["free_kv_blocks"] + st["cached_kv_blocks"] + st["used_kv_blocks"] == st["total_kv_blocks"]
    assert st["kv_usage"] == st["used_kv_blocks"] / st["total_kv_blocks"]


# ---- sampling ----------------------------------------------------------------------------------------

def test_seeded_sampling_ignores_batch_company(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([[3, 4, 5]], params)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    mixed = engine.generate([[9, 9], [3, 4, 5], [7, 1, 2, 3]], [others, params, SamplingParams(max_tokens=5, temperature=0.0)])
    assert mixed[1].token_ids == alone
    again = engine.generate([[3, 4, 5]], params)[0].token_ids
    assert again == alone


def test_logprobs_are_consistent(engine):
    got = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
    assert len(got.logprobs) == 4
    for tok, lp in zip(got.token_ids, got.logprobs):
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-6   # greedy picks the top one
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0.0


def test_many_clients_under_their_caps_cannot_grow_the_queue_without_bound(tiny_model_dir):
    # Per client at most 5 waiting, all together 20: two hundred connections flooding stay within twice
    # that, and a client sending one request at a time still gets in until that doubled bound.
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=64,
                              max_model_len=128, max_num_seqs=1, max_queued_requests_per_client=5,
                              max_queued_requests=20))
    params = SamplingParams(max_tokens=4)
    refused = 0
    for c in range(200):
        if c == 10:                             # the queue is full by now (10 clients x 5)
            eng.add_request("good", [5, 6, 7], params, client="good")
            with pytest.raises(ValidationError, match="queue full"):
                eng.add_request("good-2", [5, 6, 7], params, client="good")   # it already has one waiting
        for i in range(5):
            try:
                eng.add_request(f"c{c}-{i}", [1, 2, 3], params, client=f"c{c}")
            except ValidationError as e:
                assert e.field == "" and "queue full" in e.message
                refused += 1
    assert len(eng.scheduler.waiting) == 40 and refused == 200 * 5 - 39
    eng.add_request("mine", [1, 2, 3], params)  # in-process requests (no client) are not capped
    outs = eng.generate([[9, 9]], params)
    assert outs[0].finish_reason is not None


def test_waiting_prompt_tokens_are_capped_like_waiting_requests(tiny_model_dir):
    """max_queued_tokens bounds the prompts held while waiting (a long prompt is as costly to hold as many
    short ones): past it only a client with nothing waiting may queue one, up to twice the cap; tokens
    leave the count as their requests start or are aborted."""
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=64,
                              max_model_len=128, max_num_seqs=1, max_queued_tokens=200))
    params = SamplingParams(max_tokens=2)
    eng.add_request("a0", list(range(1, 101)), params, client="a")
    eng.add_request("a1", list(range(1, 91)), params, client="a")
    with pytest.raises(ValidationError, match="max_queued_tokens 200"):
        eng.add_request("a2", list(range(1, 21)), params, client="a")        # 210 > 200, and a has some waiting
    eng.add_request("b0", list(range(1, 101)), params, client="b")            # b has none: 290, under 400
    with pytest.raises(ValidationError, match="queue full"):
        eng.add_request("c0", list(range(1, 121)), params, client="c")        # 410: past twice the cap
    assert eng.scheduler.waiting.num_tokens() == 290 and eng.scheduler.waiting.num_tokens("a") == 190
    eng.abort("a1")
    assert eng.scheduler.waiting.num_tokens("a") == 100
    with pytest.raises(ValidationError, match="max_queued_tokens"):
        eng.add_request("a2", list(range(1, 21)), params, client="a")        # 220, and a0 still waits
    eng.step()                                                                # a0 starts: one sequence at a time
    assert eng.scheduler.waiting.num_tokens() == 100 and eng.scheduler.waiting.num_tokens("a") == 0
    eng.add_request("a2", list(range(1, 21)), params, client="a")
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.waiting.num_tokens() == 0


def test_a_lone_prompt_longer_than_the_token_cap_still_queues(tiny_model_dir):
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=64,
                              max_model_len=128, max_queued_tokens=10))
    eng.add_request("long", list(range(1, 51)), SamplingParams(max_tokens=2), client="a")
    with pytest.raises(ValidationError, match="queue full"):
        eng.add_request("more", [1, 2], SamplingParams(max_tokens=2), client="b")   # 52 > twice the cap
    assert [o.finish_reason for o in eng.generate([[3, 4]], SamplingParams(max_tokens=2))] == ["length"]


@pytest.mark.parametrize("value", [-1, -2 ** 63])
def test_a_negative_token_cap_is_refused_by_name(value):
    with pytest.raises(ValueError, match="max_queued_tokens: must be >= 0"):
        EngineConfig(model="unused", max_queued_tokens=value).validate()


def test_a_token_cap_past_any_int64_still_serves(tiny_model_dir):
    """A cap no int64 holds (2^64) is as good as none: both requests queue and decode what an engine with
    the default cap decodes."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def serve(**cap) -> dict[str, list[int]]:
        eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=64,
                                  max_model_len=128, **cap))
        eng.add_request("a", [1, 2, 3], params, client="c")
        eng.add_request("b", [4, 5, 6, 7], params, client="c")
        out = {"a": [], "b": []}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] += o.new_token_ids
        return out
    got = serve(max_queued_tokens=2 ** 64)
    vocab = ModelConfig.from_hf_dir(tiny_model_dir).vocab_size
    assert all(len(ids) == 2 and all(0 <= t < vocab for t in ids) for ids in got.values()), got
    assert got == serve()
