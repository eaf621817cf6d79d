"""Incremental detokenizer and client-side request assembly (stop strings, hold-back), on the tiny model's
real byte-level BPE tokenizer: multi-byte characters span several tokens there."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve_client.detokenizer import IncrementalDetokenizer
from llmserve_client.request_state import RequestState
from llmserve_proto import Logprobs, RequestMetrics, RequestOutput, SamplingParams

TEXTS = ["héllo 你好 🎉 world", "naïve café — 日本語のテキスト 👩‍👩‍👧", "plain ascii text, def f(x): return x",
         "🎉🎉🎉", "€"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def full_decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream_deltas(tok, ids, chunk_sizes, skip=True):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas, i = [], 0
    sizes = iter(chunk_sizes)
    while i < len(ids):
        n = max(1, next(sizes, 1))
        deltas.append(d.push(ids[i:i + n]))
        i += n
    deltas.append(d.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_streams_whole_characters(tok, text):
    ids = tok.encode(text)
    assert len(ids) > 1
    deltas = stream_deltas(tok, ids, [1] * len(ids))
    assert "".join(deltas) == text == full_decode(tok, ids)
    assert not any("\ufffd" in d for d in deltas), deltas   # no character is ever split or mangled


def test_bytes_of_one_char_are_held_back_until_complete(tok):
    ids = tok.encode("🎉")
    assert len(ids) >= 2, "the emoji must span tokens for this test to mean anything"
    d = IncrementalDetokenizer(tok)
    assert [d.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1:]) == "🎉"
    assert d.flush() == ""


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hello") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode(" there")
    assert "".join(stream_deltas(tok, ids, [1] * len(ids))) == "hello there"
    kept = "".join(stream_deltas(tok, ids, [1] * len(ids), skip=False))
    assert kept == full_decode(tok, ids, skip=False) and "<|im_end|>" in kept


def test_unfinished_character_is_released_at_the_end(tok):
    ids = tok.encode("🎉")[:-1]     # a model can stop mid-character
    deltas = stream_deltas(tok, ids, [1] * len(ids))
    assert "".join(deltas) == full_decode(tok, ids)
    assert deltas[-1].endswith("\ufffd")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_token_sequence_concatenates_to_full_decode(tok, data):
    # Arbitrary ids (including invalid byte sequences and specials), arbitrary step sizes; half of them
    # single bytes, so partial characters, stray bytes and their mixes come up often.
    one_byte = [i for i in range(len(tok)) if len(tok.convert_ids_to_tokens(i)) == 1]
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1) | st.sampled_from(one_byte), min_size=0, max_size=40))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=0, max_size=40))
    skip = data.draw(st.booleans())
    assert "".join(stream_deltas(tok, ids, sizes, skip)) == full_decode(tok, ids, skip)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30))
def test_any_unicode_text_round_trips_without_replacement_chars(tok, text):
    ids = tok.encode(text)
    deltas = stream_deltas(tok, ids, [1] * len(ids))
    assert "".join(deltas) == full_decode(tok, ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


# ---- RequestState: what Client/AsyncClient hand out ---------------------------------------------------

def feed(tok, params, ids, per_step=1, final_reason="length", logprobs=False):
    """Feed ids per_step at a time; with logprobs, token i's logprob is -i."""
    st_ = RequestState("r", [1, 2, 3], params, tok)
    chunks = []
    for i in range(0, len(ids), per_step):
        last = i + per_step >= len(ids)
        out = RequestOutput(request_id="r", token_ids=ids[i:i + per_step], finish_reason=final_reason if last else None,
                            logprobs=[Logprobs(logprob=-float(j)) for j in range(i, min(i + per_step, len(ids)))]
                            if logprobs else None,
                            metrics=RequestMetrics(arrival_time=1.0, first_token_time=1.5, finish_time=2.0,
                                                   num_prompt_tokens=3, num_cached_tokens=2) if last else None)
        c = st_.on_output(out, recv_time=10.0 + i)
        if c is not None:
            chunks.append(c)
        if st_.finished:
            break
    return st_, chunks


def test_stream_chunks_concatenate_to_completion(tok):
    ids = tok.encode("héllo 你好 🎉 world")
    state, chunks = feed(tok, SamplingParams(max_tokens=len(ids)), ids)
    comp = state.completion()
    assert "".join(c.text for c in chunks) == comp.text == full_decode(tok, ids)
    assert [t for c in chunks for t in c.token_ids] == ids == comp.token_ids
    assert chunks[-1].finish_reason == comp.finish_reason == "length"
    assert comp.usage.prompt_tokens == 3 and comp.usage.cached_tokens == 2 and comp.usage.completion_tokens == len(ids)
    assert comp.timings.core_first_token == 1.5 and comp.timings.first_chunk == 10.0
    assert len(comp.timings.token_times) == len(ids)


@pytest.mark.parametrize("per_step", [1, 2, 5])
def test_stop_string_trims_text_and_asks_for_abort(tok, per_step):
    ids = tok.encode("alpha beta STOP gamma delta")
    state, chunks = feed(tok, SamplingParams(max_tokens=100, stop=["STOP"]), ids, per_step)
    comp = state.completion()
    assert comp.text == "alpha beta " and comp.finish_reason == "stop" and comp.stop_reason == "STOP"
    assert state.needs_abort
    assert "".join(c.text for c in chunks) == comp.text
    assert not any("ST" in c.text for c in chunks)      # a stop string split across steps never leaks


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("one two three four")
    state, _ = feed(tok, SamplingParams(max_tokens=100, stop=["four", "two"]), ids)
    assert state.completion().text == "one " and state.stop_reason == "two"


def test_held_back_tail_is_released_when_no_stop_string_matches(tok):
    ids = tok.encode("nothing to see here")
    state, chunks = feed(tok, SamplingParams(max_tokens=100, stop=["a long stop string"]), ids)
    assert "".join(c.text for c in chunks) == "nothing to see here" and state.finish_reason == "length"
    assert not state.needs_abort


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_token_is_reported_and_its_text_left_out_as_a_stop_strings(tok, per_step, keep):
    ids = tok.encode("abc def\n")
    params = SamplingParams(max_tokens=100, stop_token_ids=[ids[-1]], include_stop_str_in_output=keep)
    state, chunks = feed(tok, params, ids, per_step, final_reason="stop")
    comp = state.completion()
    assert comp.finish_reason == "stop" and comp.stop_reason == ids[-1] and comp.token_ids == ids
    assert comp.text == "".join(c.text for c in chunks) == full_decode(tok, ids if keep else ids[:-1])


def test_outputs_after_a_stop_string_are_ignored(tok):
    ids = tok.encode("xx STOP yy")
    state = RequestState("r", [1], SamplingParams(max_tokens=50, stop=["STOP"]), tok)
    assert state.on_output(RequestOutput(request_id="r", token_ids=ids), 1.0).finish_reason == "stop"
    assert state.on_output(RequestOutput(request_id="r", token_ids=tok.encode(" more"), finish_reason="abort"), 2.0) is None
    assert state.completion().finish_reason == "stop"


def test_bytes_that_can_never_complete_a_character_are_not_held_back(tok):
    # A model emitting stray bytes (a random model, a logit_bias on a byte token) must neither stall the
    # stream until the end nor make every push decode the whole held-back run again (quadratic time).
    stray = next(i for i in range(len(tok))
                 if len(tok.convert_ids_to_tokens(i)) == 1 and tok.decode([i]) == "\ufffd")   # one lone byte
    ids = [stray] * 300
    d = IncrementalDetokenizer(tok)
    streamed = "".join(d.push([t]) for t in ids)
    assert streamed == "\ufffd" * 299     # only the newest token waits: no later one has shown it stray yet
    assert streamed + d.flush() == full_decode(tok, ids)


@pytest.mark.parametrize("per_step", [1, 3, 100])
def test_the_stop_string_completed_first_wins_however_tokens_are_batched(tok, per_step):
    # "o t" is complete before "two three" is: generating one token at a time stops there, and several
    # tokens per step (speculative decoding, a slow reader) must end the same way.
    # The tokens a step brought past that point were not generated one at a time: they leave the token
    # ids, their logprobs and the usage too.
    ids = tok.encode("xx two three yy")
    params = SamplingParams(max_tokens=100, stop=["two three", "o t"], logprobs=0)
    state, chunks = feed(tok, params, ids, per_step, logprobs=True)
    comp = state.completion()
    assert comp.text == "xx tw" and state.stop_reason == "o t"
    assert "".join(c.text for c in chunks) == "xx tw"
    one_by_one = feed(tok, params, ids, 1)[0].completion().token_ids
    assert len(one_by_one) < len(ids)
    assert comp.token_ids == [t for c in chunks for t in c.token_ids] == one_by_one
    assert comp.usage.completion_tokens == len(comp.logprobs) == len(one_by_one)
    assert [lp.logprob for c in chunks for lp in c.logprobs] == [-float(i) for i in range(len(one_by_one))]
