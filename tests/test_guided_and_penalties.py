"""Logits processing in the core: penalties, logit_bias and min_tokens against a reference computed here
with transformers' Qwen3 (greedy, float32, token-exact); grammars (xgrammar) from a random-weight model,
under async scheduling and with a speculative core; n > 1 prompts sharing KV through the prefix cache;
the bitmask kernel against its torch reference; the new SamplingParams fields' bounds."""
from __future__ import annotations

import json
import math
import re

import msgspec
import pytest
import torch

from llmserve_core import Engine, EngineConfig
from llmserve_core.layers.logits_processors import apply_token_bitmask_reference, bitmask_to_bool
from llmserve_core.models.tiny_draft import make_tiny_draft
from llmserve_core.speculative.policy import Decision, SpecPolicy
from llmserve_proto import GuidedDecoding, SamplingParams, ValidationError

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "note"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                         # Length-bounded strings go through a pattern (xgrammar lets control characters
                         # into them otherwise); json.loads below fails on a raw control character.
                         "note": {"type": "string", "minLength": 1, "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


def check_schema(obj) -> None:
    assert set(obj) == {"name", "age", "tags", "note"}
    assert re.fullmatch("[a-z ]{1,8}", obj["name"]) and 1 <= len(obj["note"]) <= 6
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert len(obj["tags"]) <= 3 and all(t in ("a", "b") for t in obj["tags"])


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=128,
                               max_model_len=512, **kw))


# ---- penalties, logit_bias, min_tokens against a reference ------------------------------------------------
_REFERENCE: dict = {}


def reference_greedy(hf, prompt, p: SamplingParams, eos: set[int]) -> list[int]:
    """Greedy decoding with vLLM's logits processing written out token by token, the slow way (cached:
    both schedules compare against the same reference)."""
    key = (tuple(prompt), repr(p))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_greedy(hf, prompt, p, eos)
    return _REFERENCE[key]


def _reference_greedy(hf, prompt, p: SamplingParams, eos: set[int]) -> list[int]:
    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < p.max_tokens:
            logits = hf(torch.tensor([ids])).logits[0, -1].double().tolist()
            for t, b in p.logit_bias.items():
                logits[t] += b
            if len(out) < p.min_tokens:
                for t in eos | set(p.stop_token_ids):
                    logits[t] = -math.inf
            for t in set(prompt) | set(out):
                if p.repetition_penalty != 1.0:
                    logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
            for t in set(out):
                logits[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
            tok = max(range(len(logits)), key=logits.__getitem__)
            out.append(tok)
            ids.append(tok)
            if tok in eos:
                break
    return out


PENALTY_CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.8),
    "negative-mix": dict(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.7),
    "logit-bias": dict(logit_bias={7: 0.05, 300: -100.0, 301: 2.5}),
    "min-tokens": dict(min_tokens=6, logit_bias={2: 100.0}),      # EOS pushed first, held off 6 tokens
}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logits_processing_matches_reference(tiny_model_dir, hf, async_scheduling):
    """Every case in one batch, with a plain request riding along: edits stay in their rows."""
    eng = engine(tiny_model_dir, async_scheduling=async_scheduling)
    prompts = [[5, 9, 5, 12, 40, 5, 9], [100, 200, 100, 300, 7, 7, 7, 7, 1]]
    cases = [(name, SamplingParams(max_tokens=12, temperature=0.0, **kw)) for name, kw in PENALTY_CASES.items()]
    cases.append(("plain", SamplingParams(max_tokens=12, temperature=0.0)))
    jobs = [(name, prompt, p) for name, p in cases for prompt in prompts]
    outs = eng.generate([prompt for _, prompt, _ in jobs], [p for _, _, p in jobs])
    eos = set(eng.model_info.eos_token_ids)
    for (name, prompt, p), o in zip(jobs, outs):
        assert o.token_ids == reference_greedy(hf, prompt, p, eos), name
        if name == "min-tokens":
            assert len(o.token_ids) == 7 and o.token_ids[-1] == 2 and o.finish_reason == "stop"


# ---- grammars --------------------------------------------------------------------------------------------
def guided_params(n: int, max_tokens: int = 200) -> list[SamplingParams]:
    kinds = [GuidedDecoding(kind="json", spec=json.dumps(SCHEMA)),
             GuidedDecoding(kind="regex", spec=r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)"),
             GuidedDecoding(kind="choice", choices=["yes", "no", "maybe so"]),
             GuidedDecoding(kind="grammar", spec='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
             GuidedDecoding(kind="json", spec=json.dumps(SCHEMA), prefix="<call>", suffix="</call>")]
    return [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, guided=kinds[i % len(kinds)])
            for i in range(n)]


def check_guided(text: str, g: GuidedDecoding) -> None:
    if g.kind == "json":
        assert text.startswith(g.prefix) and text.endswith(g.suffix), text
        check_schema(json.loads(text[len(g.prefix):len(text) - len(g.suffix)]))
    elif g.kind == "regex":
        assert re.fullmatch(g.spec, text), text
    elif g.kind == "choice":
        assert text in g.choices
    else:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


@pytest.mark.parametrize("cfg", [dict(), dict(async_scheduling=True), dict(async_scheduling=True, block_size=4,
                                                                           num_kv_blocks=80, max_num_batched_tokens=7)])
def test_grammars_always_match_from_random_weights(tiny_model_dir, tok, cfg):
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32",
                              **{"num_kv_blocks": 128, "max_model_len": 512, **cfg}))
    params = guided_params(10) + [SamplingParams(max_tokens=20, temperature=1.0, seed=3)]
    prompts = [tok.encode(f"Write item {i} as requested:") for i in range(len(params))]
    outs = eng.generate(prompts, params)
    for o, p in zip(outs[:-1], params):
        assert o.finish_reason == "stop", tok.decode(o.token_ids)
        assert o.token_ids[-1] in eng.model_info.eos_token_ids       # the grammar ends with EOS
        check_guided(tok.decode(o.token_ids, skip_special_tokens=True), p.guided)
    st = eng.stats()
    assert st["grammars_compiled"] == 5 and st["grammar_cache_hits"] == 5   # one compile per distinct grammar
    assert st["used_kv_blocks"] == 0        # every block freed (the prompts stay cached)


def mixed_params(greedy: bool) -> list[SamplingParams]:
    """Grammar, penalty and plain rows that end at different steps: by their grammar (one with ignore_eos,
    so its matcher terminates on EOS), by EOS, by a stop token, by max_tokens."""
    def sp(i, **kw):
        return SamplingParams(**{"temperature": 0.0 if greedy else 1.0, "seed": None if greedy else 100 + i, **kw})
    guided = [msgspec.structs.replace(p, temperature=0.0 if greedy else 1.0, seed=None if greedy else p.seed)
              for p in guided_params(5, max_tokens=40)]
    return guided + [
        sp(0, max_tokens=30, ignore_eos=True, guided=GuidedDecoding(kind="choice", choices=["yes", "no"])),
        sp(1, max_tokens=9, presence_penalty=1.5, frequency_penalty=0.5),
        sp(2, max_tokens=14, repetition_penalty=1.6, ignore_eos=True),
        sp(3, max_tokens=6, presence_penalty=-0.5, logit_bias={7: 3.0}),
        sp(4, max_tokens=11, min_tokens=4, logit_bias={2: 50.0}),        # EOS held off 4 tokens, then taken
        sp(5, max_tokens=5, ignore_eos=True),
        sp(6, max_tokens=17, stop_token_ids=[300, 301, 302]),
        sp(7, max_tokens=23, ignore_eos=True),
    ]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
@pytest.mark.parametrize("cfg", [dict(), dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=9)],
                         ids=["plain", "chunked-preempting"])
def test_async_with_grammar_and_penalty_rows_matches_sync(tiny_model_dir, tok, greedy, cfg):
    """With async scheduling, steps holding grammar and penalty rows launch their forward before the step
    in flight is read back and sample after it: tokens equal the synchronous engine's, also for requests
    that finished while the next step's forward ran (their extra row is sampled, then discarded)."""
    params = mixed_params(greedy)
    prompts = [tok.encode(f"Write item {i} as requested:") for i in range(len(params))]
    sync = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=512,
                               **{"num_kv_blocks": 128, **cfg, "async_scheduling": False}))
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=512,
                              **{"num_kv_blocks": 128, **cfg, "async_scheduling": True}))
    finished_rows = []         # rows sampled for requests already finished: what the async engine discards
    real_sample = eng.runner.launch_sample

    def launch_sample(handle):
        finished_rows.extend(r for r in handle.sampled_requests if r.is_finished)
        real_sample(handle)

    eng.runner.launch_sample = launch_sample
    want = sync.generate(prompts, params)
    got = eng.generate(prompts, params)
    for w, g, p in zip(want, got, params):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        if p.guided is not None and g.finish_reason == "stop":
            check_guided(tok.decode(g.token_ids, skip_special_tokens=True), p.guided)
    assert len({len(w.token_ids) for w in want}) > 4                    # they end at many different steps
    choice = got[5]
    assert choice.finish_reason == "stop" and tok.decode(choice.token_ids, skip_special_tokens=True) in ("yes", "no")
    assert finished_rows
    if not cfg:
        # The grammar that ended early was sampled once more, its matcher terminated (no mask to fill). With
        # a budget of 9 tokens for 13 requests it may sit the next step out.
        assert any(r.grammar is not None and r.grammar.matcher.is_terminated() for r in finished_rows)
    else:
        assert eng.stats()["num_preemptions"] > 0
    assert eng.stats()["used_kv_blocks"] == 0
    eng.block_manager.check_invariants()


def test_grammar_steps_keep_the_next_forward_in_flight(tiny_model_dir, tok):
    """While grammar and penalty rows decode, each step's forward is queued before the step in flight is
    read back, and its sampling only after that readback (the masks and counts need its tokens). Without
    async scheduling every step is read back before the next is launched."""
    params = [p for p in mixed_params(greedy=False) if p.guided is not None or p.has_penalties]
    prompts = [tok.encode(f"Item {i}:") for i in range(len(params))]
    for async_scheduling in (True, False):
        eng = engine(tiny_model_dir, async_scheduling=async_scheduling)
        events = []
        real_forward, real_sample, real_complete = eng.runner.launch_forward, eng.runner.launch_sample, eng._complete

        def launch_forward(sched):
            handle = real_forward(sched)
            events.append(("forward", handle))
            return handle

        def launch_sample(handle):
            events.append(("sample", handle))
            real_sample(handle)

        def complete(handle):
            events.append(("complete", handle))
            real_complete(handle)

        eng.runner.launch_forward, eng.runner.launch_sample, eng._complete = launch_forward, launch_sample, complete
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{i}", prompt, p)
        in_flight_after_step = []
        while eng.has_unfinished():
            eng.step()
            if eng.requests:
                in_flight_after_step.append(eng._in_flight is not None)
        where = {e: i for i, e in enumerate((kind, id(h)) for kind, h in events)}
        handles = [h for kind, h in events if kind == "forward"]
        pairs = list(zip(handles, handles[1:]))
        assert len(pairs) > 10
        for prev, nxt in pairs:
            forward, done, sample = where["forward", id(nxt)], where["complete", id(prev)], where["sample", id(nxt)]
            if async_scheduling:
                assert forward < done < sample
            else:
                assert done < forward < sample
        assert all(in_flight_after_step) if async_scheduling else not any(in_flight_after_step)


def test_a_request_finished_by_the_early_readback_survives_a_failing_sampling(tiny_model_dir):
    """The step in flight is read back in the middle of the next step (before its sampling): if that
    sampling raises, a request the readback finished still gets its last tokens and finish reason from
    the next step(), while the failed step's requests end with the error alone."""
    eng = engine(tiny_model_dir, async_scheduling=True)
    short_params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, presence_penalty=1.0)
    eng.add_request("short", [5, 6, 7], short_params)
    eng.add_request("long", [8, 9], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True,
                                                   frequency_penalty=1.0))
    real_sample, fail = eng.runner.launch_sample, []

    def launch_sample(handle):
        if fail:
            raise RuntimeError("injected sampling fault")
        real_sample(handle)

    eng.runner.launch_sample = launch_sample
    short = []
    while eng.requests["short"].num_output_tokens < 3:      # its last token in flight
        short += [t for o in eng.step() if o.request_id == "short" for t in o.new_token_ids]
    fail.append(True)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert eng.fail_step() == ["long"]
    fail.clear()
    [out] = eng.step()
    assert out.request_id == "short" and out.finish_reason == "length"
    assert short + out.new_token_ids == engine(tiny_model_dir).generate([[5, 6, 7]], short_params)[0].token_ids
    assert not eng.has_unfinished() and eng.stats()["used_kv_blocks"] == 0


def test_grammar_that_cannot_finish_ends_with_length(tiny_model_dir, tok):
    eng = engine(tiny_model_dir)
    [o] = eng.generate([tok.encode("x")], SamplingParams(max_tokens=5, temperature=1.0, seed=0,
                                                         guided=GuidedDecoding(kind="regex", spec="a{40}")))
    assert o.finish_reason == "length" and len(o.token_ids) == 5
    assert set(tok.decode(o.token_ids)) == {"a"}


# ---- a grammar that starts after the reasoning ----------------------------------------------------------
SMALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n"],
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def free_sampled(model_dir, prompt, max_tokens=30) -> list[int]:
    """A seeded sample: the same seed draws the same token at a position from the same logits."""
    return engine(model_dir).generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                               seed=3))[0].token_ids


def reasoning_marker(free: list[int], end: int) -> list[int]:
    """The two tokens of `free` ending at index `end`: a stand-in for the token(s) of `</think>`, which the
    unconstrained output shows there first."""
    marker = free[end - 1:end + 1]
    assert len(free) > end + 1 and all(free[i:i + 2] != marker for i in range(end - 1)), free
    return marker


@pytest.mark.parametrize("cfg", [dict(), dict(async_scheduling=True),
                                 dict(async_scheduling=True, block_size=4, num_kv_blocks=24)],
                         ids=["sync", "async", "async-preempting"])
def test_grammar_holds_only_after_start_after(tiny_model_dir, tok, cfg):
    """Until the output shows start_after (a thinking model's `</think>`) the request decodes as an unguided
    one would: no mask, its matcher untouched; from the next token on the grammar holds. Under async
    scheduling and through preemptions (other requests crowd a small pool) too."""
    prompt = tok.encode("Think, then answer:")
    free = free_sampled(tiny_model_dir, prompt)
    end = 6
    guided = GuidedDecoding(kind="json", spec=json.dumps(SMALL_SCHEMA), start_after=reasoning_marker(free, end))
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=512,
                              **{"num_kv_blocks": 128, **cfg}))
    eng.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=3, guided=guided))
    for i in range(3):
        eng.add_request(f"other{i}", tok.encode(f"Other {i}:"), SamplingParams(max_tokens=40, ignore_eos=True))
    req, out, finish = eng.requests["r"], [], None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == "r":
                out += o.new_token_ids
                finish = o.finish_reason or finish
        if len(out) <= end:          # the marker not seen yet: nothing was masked, the matcher never moved
            assert req.grammar.matcher is None and not req.grammar.active
    assert out[:end + 1] == free[:end + 1]
    assert finish == "stop" and out[-1] in eng.model_info.eos_token_ids
    assert json.loads(tok.decode(out[end + 1:], skip_special_tokens=True))["n"] in range(100)
    if "num_kv_blocks" in cfg:
        assert eng.stats()["num_preemptions"] > 0
    assert eng.stats()["used_kv_blocks"] == 0


def test_a_reasoning_that_never_ends_runs_to_max_tokens_unmasked(tiny_model_dir, tok):
    """The model never shows start_after: its output is the unguided one, ended by length. The compiled
    grammar is shared by requests whose start_after differs (it gates the matcher, not the grammar)."""
    prompt = tok.encode("Think, then answer:")
    free = free_sampled(tiny_model_dir, prompt, max_tokens=12)
    absent = next(t for t in range(100, 1000) if t not in free)
    eng = engine(tiny_model_dir)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=3, guided=GuidedDecoding(
        kind="json", spec=json.dumps(SMALL_SCHEMA), start_after=marker)) for marker in ([absent], [absent, absent])]
    outs = eng.generate([prompt, prompt], params)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(free, "length")] * 2
    assert eng.stats()["grammars_compiled"] == 1 and eng.stats()["grammar_cache_hits"] == 1


def test_min_tokens_holds_off_eos_while_the_grammar_waits_for_start_after(tiny_model_dir):
    """min_tokens yields to a grammar only once it holds: before start_after shows, nothing else decides
    where the output may end, so EOS stays blocked as it is for an unguided request."""
    eng = engine(tiny_model_dir)
    eos = min(eng.model_info.eos_token_ids)
    plain = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=4, logit_bias={eos: 100.0})
    free = eng.generate([[1, 2, 3]], plain)[0]
    assert len(free.token_ids) == 5 and free.token_ids[-1] == eos
    absent = next(t for t in range(100, 1000) if t not in free.token_ids)
    guided = msgspec.structs.replace(plain, guided=GuidedDecoding(kind="json_object", start_after=[absent]))
    out = eng.generate([[1, 2, 3]], guided)[0]
    assert (out.token_ids, out.finish_reason) == (free.token_ids, "stop")


@pytest.mark.parametrize("start_after, message", [([1] * 17, "0 to 16 integers"), ([-1], r"\[0\]"), ([2**31], r"\[0\]"),
                                                  (["1"], r"\[0\]"), ("vocab", "below the vocabulary")])
def test_start_after_is_bounded(tiny_model_dir, start_after, message):
    eng = engine(tiny_model_dir)
    start_after = [eng.model_info.vocab_size] if start_after == "vocab" else start_after
    with pytest.raises(ValidationError, match=message) as e:
        eng.add_request("r", [1, 2], SamplingParams(guided=GuidedDecoding(kind="json_object", start_after=start_after)))
    assert e.value.field == "guided.start_after" and not eng.requests


@pytest.mark.parametrize("guided, field", [
    (GuidedDecoding(kind="regex", spec="(unclosed"), "guided.regex"),
    (GuidedDecoding(kind="json", spec='{"type": 5}'), "guided.json"),
    (GuidedDecoding(kind="json", spec="{not json"), "guided.json"),
    (GuidedDecoding(kind="grammar", spec="root ::= missing_rule"), "guided.grammar"),
    (GuidedDecoding(kind="choice", choices=[]), "guided.choice"),
    (GuidedDecoding(kind="yaml", spec="x"), "guided.kind"),
])
def test_invalid_grammars_name_the_field_and_leave_the_engine_unchanged(tiny_model_dir, guided, field):
    eng = engine(tiny_model_dir)
    with pytest.raises(ValidationError) as e:
        eng.add_request("bad", [1, 2, 3], SamplingParams(guided=guided))
    assert e.value.field == field
    assert not eng.requests and not eng.scheduler.waiting
    [o] = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
    assert len(o.token_ids) == 3


def test_request_waits_in_queue_until_its_grammar_compiles(tiny_model_dir, tok, monkeypatch):
    """Compilation happens off the stepping thread; until it is done the request is not scheduled, and a
    plain request behind it passes."""
    import threading
    from llmserve_core.engine import grammar as grammar_mod
    gate = threading.Event()
    real = grammar_mod.GrammarService._compile

    def slow_compile(self, g):
        assert gate.wait(120)
        return real(self, g)

    monkeypatch.setattr(grammar_mod.GrammarService, "_compile", slow_compile)
    eng = engine(tiny_model_dir)
    eng.add_request("guided", tok.encode("a"), SamplingParams(max_tokens=50, temperature=1.0, seed=0,
                                                             guided=GuidedDecoding(kind="choice", choices=["ok"])))
    eng.add_request("plain", tok.encode("b"), SamplingParams(max_tokens=4, temperature=0))
    finished = {}
    while "plain" not in finished:
        for o in eng.step():
            if o.finish_reason:
                finished[o.request_id] = o
    assert "guided" not in finished and [r.request_id for r in eng.scheduler.waiting] == ["guided"]
    gate.set()
    text = []
    while "guided" not in finished:
        for o in eng.step():
            if o.request_id == "guided":
                text += o.new_token_ids
                if o.finish_reason:
                    finished["guided"] = o
    assert tok.decode(text, skip_special_tokens=True) == "ok"


def test_aborted_requests_leave_no_compilations_behind(tiny_model_dir, tok, monkeypatch):
    """A client that queues guided requests with distinct grammars and aborts them (or disconnects) must
    not leave the compile worker their grammars to work through: another client's grammar would wait
    behind all of them, and every round of it would grow the worker's queue."""
    import threading
    from llmserve_core.engine import grammar as grammar_mod
    gate = threading.Event()
    compiled = []
    real = grammar_mod.GrammarService._compile

    def gated_compile(self, g):
        assert gate.wait(120)
        compiled.append(g)
        return real(self, g)

    monkeypatch.setattr(grammar_mod.GrammarService, "_compile", gated_compile)
    eng = engine(tiny_model_dir)
    guided = [GuidedDecoding(kind="choice", choices=[f"x{i}"]) for i in range(50)]
    for i, g in enumerate(guided):            # the first occupies the worker; the rest queue behind it
        eng.add_request(f"flood{i}", tok.encode("a"), SamplingParams(max_tokens=4, guided=g))
    eng.add_request("twin", tok.encode("b"), SamplingParams(max_tokens=16, guided=guided[-1]))
    for i in range(len(guided)):
        eng.abort(f"flood{i}")
    eng.add_request("again", tok.encode("c"), SamplingParams(max_tokens=16, guided=guided[1]))
    eng.add_request("good", tok.encode("d"), SamplingParams(max_tokens=16, temperature=0,
                                                           guided=GuidedDecoding(kind="choice", choices=["ok"])))
    gate.set()
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
    assert finished == {**{f"flood{i}": "abort" for i in range(len(guided))}, "twin": "stop", "again": "stop",
                        "good": "stop"}
    # The one already compiling, the twin's (still wanted), the one asked for again, and the good one's.
    assert len(compiled) == 4
    assert not eng.grammars._holders


def test_a_grammar_failing_as_a_step_starts_ends_only_its_request(tiny_model_dir, tok, monkeypatch):
    """Compilation runs beside the step loop, so it may fail after a step dropped the failed grammars and
    before it schedules: the request must not start then (its mask cannot be built, and the failing step
    would take every request of its batch down) but end with "abort" at the next step."""
    import threading
    from llmserve_core.engine import grammar as grammar_mod
    gate = threading.Event()

    def failing_compile(self, g):
        assert gate.wait(120)
        raise RuntimeError("grammar too large")

    monkeypatch.setattr(grammar_mod.GrammarService, "_compile", failing_compile)
    eng = engine(tiny_model_dir)
    eng.add_request("guided", tok.encode("a"), SamplingParams(max_tokens=8, temperature=1.0, seed=0,
                                                             guided=GuidedDecoding(kind="choice", choices=["ok"])))
    eng.add_request("plain", tok.encode("b"), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    grammar = eng.requests["guided"].grammar
    real_drop = eng._drop_failed_grammars

    def drop_then_fail():
        real_drop()
        gate.set()
        grammar.future.exception(timeout=120)      # the compilation has failed by the time the step schedules

    monkeypatch.setattr(eng, "_drop_failed_grammars", drop_then_fail)
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
    assert finished == {"guided": "abort", "plain": "length"}
    assert eng.stats()["used_kv_blocks"] == 0


def test_grammar_and_penalty_requests_decode_plainly_in_a_speculative_core(tiny_model_dir, tok, tmp_path):
    """Requests with a grammar or penalties never draft (exactness without per-draft masks); the others
    in the same batch still do, and greedy output equals the plain engine's."""
    draft = make_tiny_draft(tmp_path / "draft", tiny_model_dir, seed=1)
    spec = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=128,
                               max_model_len=512, speculative_model=draft, speculative_policy="always"))
    plain = engine(tiny_model_dir)
    params = guided_params(5, max_tokens=100) + [SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=1.0),
                                                 SamplingParams(max_tokens=12, temperature=0.0)]
    prompts = [tok.encode(f"Item {i}:") for i in range(len(params))]
    for r_id, p in enumerate(params):
        spec.add_request(f"r{r_id}", prompts[r_id], p)
    assert [spec.requests[f"r{i}"].speculative for i in range(len(params))] == [False] * 6 + [True]
    for rid in list(spec.requests):
        spec.abort(rid)
    while spec.has_unfinished():
        spec.step()
    spec_outs = spec.generate(prompts, params)
    plain_outs = plain.generate(prompts, params)
    for s, p_out, p in zip(spec_outs, plain_outs, params):
        assert s.token_ids == p_out.token_ids
        if p.guided is not None:
            check_guided(tok.decode(s.token_ids, skip_special_tokens=True), p.guided)
    assert spec.stats()["spec_num_draft_tokens"] > 0       # the plain greedy request drafted



class _AlternatingPolicy(SpecPolicy):
    """One plain step in four (the measured policy may never draft on the CPU); the first drafting step
    after a plain one only catches the draft up, the next ones draft."""

    def __init__(self, widths):
        super().__init__(widths)
        self.calls = 0

    def _decide(self, batch, num_spec, costs):
        self.calls += 1
        return Decision(0 if self.calls % 4 == 0 else self.deepest)


def test_async_plain_steps_launch_ahead_while_logits_processing_requests_run(tiny_model_dir, tok, tmp_path):
    """An adaptive speculative core launches plain steps ahead also while a request whose logits depend on
    its last token (grammar, penalties) runs: only their sampling waits for the step before. Drafting
    steps complete the step in flight first; such requests sample through their processors on both the
    plain step and a drafting step's plain rows, so output equals the plain engine's."""
    draft = make_tiny_draft(tmp_path / "draft", tiny_model_dir, seed=1)
    spec = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=128,
                               max_model_len=512, speculative_model=draft, async_scheduling=True))
    spec.policy = _AlternatingPolicy(spec.spec.policy_widths())
    plain = engine(tiny_model_dir)
    params = guided_params(2, max_tokens=60) + [
        SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=1.5, repetition_penalty=1.3),
        SamplingParams(max_tokens=10, temperature=0.0, logit_bias={7: 5.0}, min_tokens=8),
        SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)]
    prompts = [tok.encode(f"Item {i}:") for i in range(len(params))]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        spec.add_request(f"r{i}", prompt, p)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(params))}
    overlapped_with_sync_rows = False
    while spec.has_unfinished():
        for o in spec.step():
            outs[o.request_id] += o.new_token_ids
        if spec._in_flight is not None:
            assert spec.policy.last.gamma == 0          # drafting steps are synchronous
            overlapped_with_sync_rows |= any(r.needs_sync for r in spec._in_flight.sampled_requests)
    want = plain.generate(prompts, params)
    for i, (w, p) in enumerate(zip(want, params)):
        assert outs[f"r{i}"] == w.token_ids
        if p.guided is not None:
            check_guided(tok.decode(outs[f"r{i}"], skip_special_tokens=True), p.guided)
    st = spec.stats()
    assert overlapped_with_sync_rows
    assert st["spec_num_drafted_steps"] > 0 and st["spec_num_plain_steps"] > 0 and st["spec_num_draft_tokens"] > 0

# ---- n > 1: copies share the prompt's KV --------------------------------------------------------------
def test_identical_prompts_share_prefix_blocks(tiny_model_dir, tok):
    eng = engine(tiny_model_dir)
    prompt = tok.encode("A prompt long enough to fill several KV blocks of sixteen tokens each, "
                        "so that the copies can share them through the prefix cache.")
    assert len(prompt) > 3 * 16
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(4)]
    outs = eng.generate([prompt] * 4, params)
    full = (len(prompt) - 1) // 16
    assert [o.num_cached_tokens for o in outs] == [0] + [full * 16] * 3
    assert eng.stats()["prefix_hits"] == 3 * full * 16


# ---- the bitmask ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [31, 32, 33, 1000, 1056])
def test_bitmask_reference_matches_xgrammar_kernel(vocab):
    import xgrammar
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=g)
    rows = [0, 2, 3]
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask_reference(ours, bitmask, rows)
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
    assert torch.equal(ours, theirs)
    allowed = bitmask_to_bool(bitmask, vocab)
    assert torch.equal(torch.isinf(ours[rows]), ~allowed[rows]) and torch.equal(ours[1], logits[1])


# ---- bounds of the new fields ---------------------------------------------------------------------------
BAD = [("presence_penalty", v) for v in (2.5, -2.01, math.nan, math.inf, -math.inf, 2**63, True)] + \
      [("frequency_penalty", v) for v in (3.0, math.nan, -2**63)] + \
      [("repetition_penalty", v) for v in (0.0, -1.0, 1e-300 * 0, math.nan, math.inf, 101.0, 2**64)] + \
      [("min_tokens", v) for v in (-1, 17, 2**63, 2**64, -2**63)] + \
      [("logit_bias", v) for v in ({1: 101.0}, {1: math.nan}, {1: -math.inf}, {-1: 1.0}, {2**63: 1.0},
                                   {i: 1.0 for i in range(1025)})]


@pytest.mark.parametrize("field, value", BAD)
def test_new_fields_reject_out_of_range_values(field, value):
    with pytest.raises(ValidationError) as e:
        SamplingParams(max_tokens=16, **{field: value}).validate()
    assert e.value.field == field


def test_new_fields_survive_the_wire_and_extremes_are_refused_by_the_client():
    from llmserve_client.errors import RequestError
    from llmserve_client.inputs import build_params
    p = build_params(dict(max_tokens=8, presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1e-300,
                          logit_bias={5: -100, 6: 100.0}, min_tokens=8, include_stop_str_in_output=True,
                          guided={"kind": "choice", "choices": ["a"]}))
    assert p.logit_bias == {5: -100, 6: 100.0} and p.guided.choices == ["a"] and p.min_tokens == 8
    for field, bad in (("logit_bias", dict(logit_bias={2**64: 1.0})), ("min_tokens", dict(min_tokens=2**64)),
                       ("guided", dict(guided={"kind": "regex", "x": 1})),
                       ("logit_bias", dict(logit_bias={"5": 1.0})),     # OpenAI's string keys
                       ("guided", dict(guided={"kind": "regex", "spec": 5}))):
        with pytest.raises(RequestError) as e:
            build_params(bad)
        assert e.value.field == field


def test_stop_strings_need_the_detokenized_text():
    """Both clients build their requests' params here: stop strings match detokenized text only."""
    from llmserve_client.errors import RequestError
    from llmserve_client.inputs import build_params
    for stop in ("x", ["x", "yz"]):
        with pytest.raises(RequestError, match="detokenize=True") as e:
            build_params(dict(max_tokens=4, stop=stop), detokenize=False)
        assert e.value.field == "stop"
        assert build_params(dict(max_tokens=4, stop=stop)).stop == ([stop] if isinstance(stop, str) else stop)
    assert build_params(dict(max_tokens=4), detokenize=False).stop == []


def test_logit_bias_token_outside_vocab_is_refused(tiny_model_dir):
    eng = engine(tiny_model_dir)
    with pytest.raises(ValidationError) as e:
        eng.add_request("r", [1, 2], SamplingParams(logit_bias={eng.model_info.vocab_size: 1.0}))
    assert e.value.field == "logit_bias"


def test_grammar_mask_cost_smoke(tmp_path):
    """benchmarks/grammar_mask_cost.py end to end on the tiny shape (the H200 run uses the 8B shape)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "grammar.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks/grammar_mask_cost.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 8] and all(r["json_schema_ms"] > 0 for r in res["rows"])
