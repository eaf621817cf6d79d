"""The qwen3 reasoning parser and the hermes tool-call parser on text, whole and streamed at every split."""
from __future__ import annotations

import json

import pytest

from llmserve_client.http.chat_output import ChoiceShaper
from llmserve_client.http.reasoning import split_reasoning
from llmserve_client.http.tool_parsers import parse_tool_calls

REASONING_CASES = [
    # (output text, template opened <think>, reasoning, content)
    ("<think>\nweigh it\n</think>\n\nThe answer.", False, "\nweigh it\n", "The answer."),
    ("weigh it</think>\n\nThe answer.", True, "weigh it", "The answer."),
    ("still thinking, cut short", True, "still thinking, cut short", None),
    ("<think>never closed <", False, "never closed <", None),
    ("Just an answer, <think> late is text", False, None, "Just an answer, <think> late is text"),
    ("<thin", False, None, "<thin"),
    ("", True, "", None),
]


@pytest.mark.parametrize("text, opened, reasoning, content", REASONING_CASES)
def test_reasoning_split_whole(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)


def stream_in_pieces(shaper: ChoiceShaper, text: str, cuts: list[int]) -> tuple[str, str, list[dict]]:
    reasoning, content, calls = "", "", []
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        d = shaper.delta(text[a:b], final=i == len(bounds) - 2)
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
        calls += d.get("tool_calls", [])
    return reasoning, content, calls


@pytest.mark.parametrize("text, opened, reasoning, content", REASONING_CASES)
def test_reasoning_streamed_at_every_split_equals_whole(text, opened, reasoning, content):
    prompt = "<|im_start|>assistant\n<think>\n" if opened else "<|im_start|>assistant\n"
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 3)):
            r, c, _ = stream_in_pieces(ChoiceShaper(True, prompt, False), text, sorted({cut, cut2}))
            assert (r, c or None) == (reasoning or "", content), (cut, cut2)


CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "when": {"d": 2}}}\n'
         '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "}"}}\n</tool_call>')


def test_hermes_whole():
    content, calls = parse_tool_calls(CALLS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "when": {"d": 2}}
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": "}"}
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    deep = "<tool_call>\n" + "[" * 5000 + "\n</tool_call>"     # a model may nest past the JSON parser's depth
    assert parse_tool_calls(deep) == (deep, [])
    assert ChoiceShaper(False, "", True).delta(deep, final=True) == {"content": deep}


def test_hermes_streamed_at_every_split_like_openai():
    expected = [json.loads(c["function"]["arguments"]) for c in parse_tool_calls(CALLS)[1]]
    for cut in range(len(CALLS) + 1):
        shaper = ChoiceShaper(False, "", True)
        _, content, deltas = stream_in_pieces(shaper, CALLS, [cut, min(len(CALLS), cut + 7)])
        assert content == "Let me check.\n", cut
        heads = [d for d in deltas if "id" in d]
        assert [h["function"]["name"] for h in heads] == ["get_weather", "add"] and [h["index"] for h in heads] == [0, 1]
        for i, want in enumerate(expected):
            mine = [d for d in deltas if d["index"] == i]
            assert "id" in mine[0] and all("id" not in d for d in mine[1:])      # id and name first
            assert json.loads("".join(d["function"]["arguments"] for d in mine)) == want, cut
        assert shaper.finish_reason("stop") == "tool_calls"


def test_hermes_full_message_and_finish_reason():
    msg, finish = ChoiceShaper(True, "", True).message("<think>plan</think>\n\n" + CALLS, "stop")
    assert finish == "tool_calls" and msg["reasoning_content"] == "plan" and msg["content"] == "Let me check."
    assert len(msg["tool_calls"]) == 2 and msg["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    msg, finish = ChoiceShaper(False, "", True).message("plain answer", "length")
    assert finish == "length" and msg == {"role": "assistant", "content": "plain answer"}


@pytest.mark.parametrize("text", [
    "ok <tool_call>\n{not json}\n</tool_call> and more",      # closed, but not JSON
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',  # JSON, but no name
    "ok <tool_call>\n{not json",                                # cut short inside it
    '<tool_call>\n{"name": "a\\x", "arguments": {"q": 1}}\n</tool_call>',   # a name JSON cannot decode
    '<tool_call>\n{"name": "a\nb", "arguments": {"q": 1}}\n</tool_call>',
])
def test_hermes_streamed_malformed_call_is_content_as_whole(text):
    """A call that does not parse is text, streamed or not, and no call means no "tool_calls" finish."""
    assert parse_tool_calls(text) == (text, [])
    for cut in range(len(text) + 1):
        shaper = ChoiceShaper(False, "", True)
        _, content, deltas = stream_in_pieces(shaper, text, [cut, min(len(text), cut + 5)])
        assert (content, deltas) == (text, []), cut
        assert shaper.finish_reason("stop") == "stop", cut


def test_hermes_streamed_call_indexes_count_only_calls_sent():
    text = ("<tool_call>\n{not json}\n</tool_call>"
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    shaper = ChoiceShaper(False, "", True)
    _, _, deltas = stream_in_pieces(shaper, text, [])
    assert {d["index"] for d in deltas} == {0} and deltas[0]["function"]["name"] == "add"
    assert shaper.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("args", ['"{\\"a\\": 1}"', '[1, 2]', '{"a": "}"}'])
def test_hermes_streamed_arguments_equal_whole_whatever_their_json_type(args):
    """A model may write the arguments as a JSON string: streamed, they are its text, as in whole responses
    (not the string's JSON spelling)."""
    text = '<tool_call>\n{"name": "f", "arguments": ' + args + '}\n</tool_call>'
    (call,) = parse_tool_calls(text)[1]
    for cut in range(len(text) + 1):
        _, _, deltas = stream_in_pieces(ChoiceShaper(False, "", True), text, [cut, min(len(text), cut + 4)])
        streamed = "".join(d["function"]["arguments"] for d in deltas)
        assert json.loads(streamed) == json.loads(call["function"]["arguments"]), cut


def test_parallel_tool_calls_false_keeps_only_the_first_call_whole_and_streamed():
    """OpenAI's parallel_tool_calls=false: at most one call, as vLLM does it (the first; later ones dropped)."""
    msg, finish = ChoiceShaper(False, "", True, parallel_tool_calls=False).message(CALLS, "stop")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"] and finish == "tool_calls"
    for cut in range(len(CALLS) + 1):
        shaper = ChoiceShaper(False, "", True, parallel_tool_calls=False)
        _, content, deltas = stream_in_pieces(shaper, CALLS, [cut, min(len(CALLS), cut + 7)])
        assert content == "Let me check.\n" and {d["index"] for d in deltas} == {0}, cut
        assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Oslo", "when": {"d": 2}}
        assert shaper.finish_reason("stop") == "tool_calls"
