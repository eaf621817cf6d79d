"""The qwen3 reasoning parser and the hermes and qwen3_coder tool-call parsers on text, whole and streamed at
every split; a whole answer always equals the streamed one (also for outputs cut off anywhere)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")         # the llmserve_client.http package imports its starlette app
pytest.importorskip("uvicorn")

from llmserve_client.http.chat_output import ChoiceShaper  # noqa: E402
from llmserve_client.http.qwen3_coder import typed_value  # noqa: E402
from llmserve_client.http.reasoning import split_reasoning  # noqa: E402
from llmserve_client.http.tool_parsers import detect_parser, fold_deltas, parse_tool_calls  # noqa: E402

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
            r, c, _ = stream_in_pieces(ChoiceShaper(True, prompt), text, sorted({cut, cut2}))
            assert (r, c or None) == (reasoning or "", content), (cut, cut2)


CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "when": {"d": 2}}}\n'
         '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "}"}}\n</tool_call>')


def test_hermes_whole():
    content, calls = parse_tool_calls(CALLS)
    assert content == "Let me check."          # the whitespace that leads into the first call is dropped
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "when": {"d": 2}}
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": "}"}
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    deep = "<tool_call>\n" + "[" * 5000 + "\n</tool_call>"     # a model may nest past the JSON parser's depth
    assert parse_tool_calls(deep) == (deep, [])
    assert ChoiceShaper(False, "", "hermes").delta(deep, final=True) == {"content": deep}


def test_hermes_streamed_at_every_split_like_openai():
    expected = [json.loads(c["function"]["arguments"]) for c in parse_tool_calls(CALLS)[1]]
    for cut in range(len(CALLS) + 1):
        shaper = ChoiceShaper(False, "", "hermes")
        _, content, deltas = stream_in_pieces(shaper, CALLS, [cut, min(len(CALLS), cut + 7)])
        assert content == "Let me check.", cut
        heads = [d for d in deltas if "id" in d]
        assert [h["function"]["name"] for h in heads] == ["get_weather", "add"] and [h["index"] for h in heads] == [0, 1]
        for i, want in enumerate(expected):
            mine = [d for d in deltas if d["index"] == i]
            assert "id" in mine[0] and all("id" not in d for d in mine[1:])      # id and name first
            assert json.loads("".join(d["function"]["arguments"] for d in mine)) == want, cut
        assert shaper.finish_reason("stop") == "tool_calls"


def test_hermes_full_message_and_finish_reason():
    msg, finish = ChoiceShaper(True, "", "hermes").message("<think>plan</think>\n\n" + CALLS, "stop")
    assert finish == "tool_calls" and msg["reasoning_content"] == "plan" and msg["content"] == "Let me check."
    assert len(msg["tool_calls"]) == 2 and msg["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    msg, finish = ChoiceShaper(False, "", "hermes").message("plain answer", "length")
    assert finish == "length" and msg == {"role": "assistant", "content": "plain answer"}


@pytest.mark.parametrize("text", [
    "ok <tool_call>\n{not json}\n</tool_call> and more",      # closed, but not JSON
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',  # JSON, but no name
    '<tool_call>\n{"name": "a\\x", "arguments": {"q": 1}}\n</tool_call>',   # a name JSON cannot decode
    '<tool_call>\n{"name": "a\nb", "arguments": {"q": 1}}\n</tool_call>',
])
def test_hermes_streamed_malformed_call_is_content_as_whole(text):
    """A call that does not parse is text, streamed or not, and no call means no "tool_calls" finish."""
    assert parse_tool_calls(text) == (text, [])
    for cut in range(len(text) + 1):
        shaper = ChoiceShaper(False, "", "hermes")
        _, content, deltas = stream_in_pieces(shaper, text, [cut, min(len(text), cut + 5)])
        assert (content, deltas) == (text, []), cut
        assert shaper.finish_reason("stop") == "stop", cut


def test_hermes_streamed_call_indexes_count_only_calls_sent():
    text = ("<tool_call>\n{not json}\n</tool_call>"
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    shaper = ChoiceShaper(False, "", "hermes")
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
        _, _, deltas = stream_in_pieces(ChoiceShaper(False, "", "hermes"), text, [cut, min(len(text), cut + 4)])
        streamed = "".join(d["function"]["arguments"] for d in deltas)
        assert json.loads(streamed) == json.loads(call["function"]["arguments"]), cut


def test_parallel_tool_calls_false_keeps_only_the_first_call_whole_and_streamed():
    """OpenAI's parallel_tool_calls=false: at most one call, as vLLM does it (the first; later ones dropped)."""
    msg, finish = ChoiceShaper(False, "", "hermes", parallel_tool_calls=False).message(CALLS, "stop")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"] and finish == "tool_calls"
    for cut in range(len(CALLS) + 1):
        shaper = ChoiceShaper(False, "", "hermes", parallel_tool_calls=False)
        _, content, deltas = stream_in_pieces(shaper, CALLS, [cut, min(len(CALLS), cut + 7)])
        assert content == "Let me check." and {d["index"] for d in deltas} == {0}, cut
        assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Oslo", "when": {"d": 2}}
        assert shaper.finish_reason("stop") == "tool_calls"


# ---- one answer, streamed or whole, wherever the output ends ---------------------------------------------
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hot": {"type": "boolean"}, "where": {"type": "object"},
                                     "tags": {"type": "array"}, "ratio": {"type": "number"},
                                     "maybe": {"type": ["integer", "null"]}}}}}]
CODER_CALLS = ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=hot>\nfalse\n</parameter>\n<parameter=where>\n"
               '{"lat": 1.5}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=ratio>\n'
               "0.25\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n</function>\n</tool_call>\n"
               "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n</parameter>\n"
               "</function>\n</tool_call>")


def streamed_answer(parser: str, text: str, cuts: list[int], tools=None) -> tuple[str | None, list[dict]]:
    shaper = ChoiceShaper(False, "", parser, tools=tools)
    _, content, deltas = stream_in_pieces(shaper, text, cuts)
    return content or None, fold_deltas(deltas)


def same_calls(a: list[dict], b: list[dict]) -> bool:
    """Equal but for the ids each parse makes up."""
    strip = lambda calls: [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return strip(a) == strip(b)


@pytest.mark.parametrize("parser, text, tools", [("hermes", CALLS, None), ("qwen3_coder", CODER_CALLS, WEATHER)])
def test_every_cut_off_output_answers_the_same_streamed_and_whole(parser, text, tools):
    """max_tokens may end the output anywhere: for every prefix, the whole answer equals the streamed one at
    several chunkings. A call cut off once its name is known is a call (its arguments what was written);
    one cut off before is dropped, with its markup."""
    for end in range(len(text) + 1):
        out = text[:end]
        content, calls = parse_tool_calls(out, parser, tools)
        for cuts in ([], [end // 2], list(range(0, end, 3)), list(range(0, end, 1 + end % 5))):
            s_content, s_calls = streamed_answer(parser, out, cuts, tools)
            assert s_content == content and same_calls(s_calls, calls), (end, cuts)
        if "<tool_call>" in out:
            assert content is None or "<tool_call>" not in content, (end, content)


def test_hermes_call_cut_off_keeps_its_name_and_the_arguments_written():
    text = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    content, [call] = parse_tool_calls(text)
    assert content == "Hi" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Os'}
    msg, finish = ChoiceShaper(False, "", "hermes").message(text, "length")
    assert finish == "length" and msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Os'
    assert parse_tool_calls('Hi <tool_call>\n{"na') == ("Hi", [])                 # no name yet: dropped
    assert parse_tool_calls("Hi <tool_call>\n{not json") == ("Hi", [])


def test_qwen3_coder_whole_types_arguments_by_the_schema():
    content, calls = parse_tool_calls(CODER_CALLS, "qwen3_coder", WEATHER)
    assert content == "I will look." and [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "city": "São Paulo", "days": 3, "hot": False, "where": {"lat": 1.5}, "tags": ["a", "b"], "ratio": 0.25,
        "maybe": None}
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "line one\nline two"}
    # Streamed: id and name first, then one fragment per parameter, "}" at </function>.
    deltas = ChoiceShaper(False, "", "qwen3_coder", tools=WEATHER).delta(CODER_CALLS, final=True)["tool_calls"]
    assert [d["function"]["arguments"] for d in deltas[:3]] == ["", '{"city": "São Paulo"', ', "days": 3']
    msg, finish = ChoiceShaper(False, "", "qwen3_coder", tools=WEATHER).message(CODER_CALLS, "stop")
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 2


@pytest.mark.parametrize("text", [
    "ok <tool_call>\nnot a function\n</tool_call> and more",                      # no <function=...>
    "<tool_call>\n<function>\n</function>\n</tool_call>",                         # no name
    "<tool_call><function=\n</tool_call>",
    "plain text with <function=x> but no call",
])
def test_qwen3_coder_malformed_call_is_text(text):
    assert parse_tool_calls(text, "qwen3_coder") == (text, [])
    for cut in range(len(text) + 1):
        assert streamed_answer("qwen3_coder", text, [cut, min(len(text), cut + 5)]) == (text, []), cut


def test_qwen3_coder_tolerates_missing_closing_tags_and_unknown_tools():
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</tool_call>"
    [call] = parse_tool_calls(text, "qwen3_coder", WEATHER)[1]
    assert call["function"] == {"name": "f", "arguments": '{"a": "1", "b": "x"}'}   # f has no schema: text


def test_qwen3_coder_never_fails_on_garbage():
    import random
    pieces = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">", "\n",
              "get_weather", "days", "3", '{"a":', "[", "null", "true", "é", " ", "<", "/"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(30)))
        content, calls = parse_tool_calls(text, "qwen3_coder", WEATHER)
        cuts = sorted(rng.randrange(len(text) + 1) for _ in range(3))
        s_content, s_calls = streamed_answer("qwen3_coder", text, cuts, WEATHER)
        assert s_content == content and same_calls(s_calls, calls), text


@pytest.mark.parametrize("text, schema, value", [
    ("42", {"type": "integer"}, 42),
    (str(2**64), {"type": "integer"}, 2**64),
    ("-9223372036854775808", {"type": "integer"}, -2**63),
    ("4.0", {"type": "integer"}, 4),
    ("4.5", {"type": "integer"}, "4.5"),          # not what the schema says: text
    ("1e-300", {"type": "number"}, 1e-300),
    ("1e400", {"type": "number"}, "1e400"),       # not finite: JSON has no such number
    ("NaN", {"type": "number"}, "NaN"),
    ("inf", {"type": "number"}, "inf"),
    ("TRUE", {"type": "boolean"}, True),
    ("yes", {"type": "boolean"}, "yes"),
    ("null", {"type": "string"}, "null"),         # a string schema keeps the text
    ("null", {"type": ["integer", "null"]}, None),
    ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),     # a Python literal, as models write
    ("{1, 2}", {"type": "array"}, "{1, 2}"),      # a set: not JSON
    ("[" * 5000, {"type": "array"}, "[" * 5000),  # nested past any parser's depth
    ("7", {"enum": [1, 7]}, 7),
    ("7", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 7),
    (" spaced ", None, " spaced "),
])
def test_typed_value(text, schema, value):
    assert typed_value(text, schema) == value and type(typed_value(text, schema)) is type(value)


def test_detect_parser_from_each_template():
    from helpers.chat_model import QWEN3_CODER_TEMPLATE, QWEN3_TEMPLATE, QWEN3_THINKING_2507_TEMPLATE
    assert detect_parser(QWEN3_TEMPLATE) == "hermes"
    assert detect_parser(QWEN3_THINKING_2507_TEMPLATE) == "hermes"
    assert detect_parser(QWEN3_CODER_TEMPLATE) == "qwen3_coder"
    assert detect_parser({"default": "{{ x }}", "tool_use": QWEN3_CODER_TEMPLATE}) == "qwen3_coder"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_parser(None) is None


def test_thinking_2507_template_opens_the_block_so_only_the_close_is_generated(tmp_path):
    """The 2507 Thinking template ends its prompt inside <think>: the output's text up to </think> is
    reasoning, whole and streamed, and a grammar waits for the model's </think>."""
    from transformers import AutoTokenizer

    from llmserve_client.http.chat_output import guided_after_reasoning, render_chat
    from helpers.chat_model import QWEN3_THINKING_2507_TEMPLATE, make_qwen3_chat_model
    tok = AutoTokenizer.from_pretrained(make_qwen3_chat_model(tmp_path / "m", template=QWEN3_THINKING_2507_TEMPLATE))
    _, prompt = render_chat(tok, [{"role": "user", "content": "hi"}], None, None)
    assert prompt.endswith("<think>\n")
    text = "Let me weigh it.\n</think>\n\nThe answer."
    msg, _ = ChoiceShaper(True, prompt).message(text, "stop")
    assert (msg["reasoning_content"], msg["content"]) == ("Let me weigh it.\n", "The answer.")
    for cut in range(len(text) + 1):
        r, c, _ = stream_in_pieces(ChoiceShaper(True, prompt), text, [cut])
        assert (r, c) == ("Let me weigh it.\n", "The answer."), cut
    assert guided_after_reasoning({"kind": "json_object"}, prompt, [7])["start_after"] == [7]
