"""Chat prompts in (messages, tools, template kwargs) and a choice's text out (content, reasoning, tool calls).

`render_chat` runs the tokenizer's chat template with the request's tools and `chat_template_kwargs`
(e.g. Qwen3's `enable_thinking`). `ChoiceShaper` turns one choice's generated text into OpenAI's message
(or, streaming, its deltas) through the configured reasoning and tool-call parsers.
"""
from __future__ import annotations

from llmserve_client.http.reasoning import ReasoningStream, prompt_closes_thinking, prompt_opens_thinking, \
    split_reasoning
from llmserve_client.http.schemas import ApiError
from llmserve_client.http.tool_parsers import new_stream, parse_tool_calls

# Arguments the server passes itself; a request may not override them through chat_template_kwargs.
_RESERVED = {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "return_dict",
             "continue_final_message", "chat_template", "documents"}


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, kwargs: dict | None
                ) -> tuple[list[int], str]:
    """(prompt token ids, prompt text) through the tokenizer's chat template."""
    kwargs = dict(kwargs or {})
    bad = sorted(_RESERVED & set(kwargs))
    if bad:
        raise ApiError(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError("the model's tokenizer has no chat template", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                             **kwargs)
    except Exception as e:   # a template that refuses these messages
        raise ApiError(f"the chat template failed on these messages: {e}", "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False)), text


def guided_after_reasoning(guided: dict | None, prompt_text: str, end_ids: list[int] | None) -> dict | None:
    """With a reasoning parser (end_ids: the token ids of `</think>`), a grammar holds only on the answer:
    from the token after the model's `</think>` (SamplingParams.guided.start_after), then after the blank
    line Qwen3 writes there. Unless the prompt closed the thinking already: then the output is the answer
    from its first token, which the grammar holds as it is."""
    if guided is None or end_ids is None or prompt_closes_thinking(prompt_text):
        return guided
    return {**guided, "start_after": end_ids, "prefix": "\n\n" + guided.get("prefix", "")}


class ChoiceShaper:
    """One chat choice's text -> message fields, whole or as stream deltas.

    tool_parser: the format its tool calls are parsed in (None: no tools, the text is content); tools: the
    request's, whose schemas type qwen3_coder's arguments; max_calls: calls kept (OpenAI's
    parallel_tool_calls=false allows one: as vLLM does, the first is kept, later ones dropped)."""

    def __init__(self, reasoning: bool, prompt_text: str, tool_parser: str | None = None,
                 parallel_tool_calls: bool = True, tools: list[dict] | None = None, max_calls: int | None = None):
        self.reasoning = reasoning
        # A grammar holds only after the model's </think> here (guided_after_reasoning): its output is content.
        self.opened = reasoning and prompt_opens_thinking(prompt_text)
        self.tool_parser, self.tools = tool_parser, tools
        self.max_calls = 1 if not parallel_tool_calls else max_calls
        self._reasoning = ReasoningStream(self.opened) if reasoning else None
        self._tools = new_stream(tool_parser, tools) if tool_parser else None

    # ---- whole responses ------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if not self.reasoning and not self.tool_parser:
            return {"role": "assistant", "content": text}, finish_reason
        reasoning, content = split_reasoning(text, self.opened) if self.reasoning else (None, text)
        msg: dict = {"role": "assistant"}
        if self.tool_parser and content:
            content, calls = parse_tool_calls(content, self.tool_parser, self.tools)
            calls = calls[:self.max_calls]
            if calls:
                msg["tool_calls"] = calls
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        msg["content"] = content or None
        if self.reasoning:
            msg["reasoning_content"] = reasoning
        return msg, finish_reason

    # ---- streaming ------------------------------------------------------------------------------
    def delta(self, text: str, final: bool = False) -> dict:
        """The delta fields for new text (final: the output ended, release what was held back)."""
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if final:
                r2, c2 = self._reasoning.flush()
                reasoning, content = reasoning + r2, content + c2
        calls: list[dict] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if final:
                c2, more = self._tools.flush()
                content, calls = content + c2, calls + more
            if self.max_calls is not None:
                calls = [c for c in calls if c["index"] < self.max_calls]
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if self._tools is not None and self._tools.num_calls and finish_reason == "stop":
            return "tool_calls"
        return finish_reason
