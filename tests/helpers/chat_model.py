"""A tiny random Qwen3 whose tokenizer and chat template behave like Qwen3's for the OpenAI features:
`<think>`/`</think>` and `<tool_call>`/`</tool_call>` as added (non-special) tokens, a few of the JSON
punctuation tokens Qwen3's vocabulary has, and a chat template that renders tools, tool calls, tool
results and thinking blocks as Qwen3's does (`enable_thinking: false` writes an empty block;
`open_think: true` opens one, as the thinking-only Qwen3 templates do).

Two more templates, cut down from the published ones but keeping what tells them apart:
- QWEN3_CODER_TEMPLATE (Qwen3-Coder-*-Instruct): tools listed as XML `<function><name>...` under "You have
  access to the following functions", calls taught and rendered as `<tool_call>\n<function=NAME>\n
  <parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>`; no thinking.
- QWEN3_THINKING_2507_TEMPLATE (Qwen3-*-Thinking-2507): Qwen3's hermes tools, no `enable_thinking` switch,
  and a generation prompt that opens `<think>` itself, so the model writes only the closing `</think>`."""
from __future__ import annotations

import json
from pathlib import Path

from llmserve_core.models.tiny import make_tiny_model

ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>",
         '",', '":', '"}', '"]', '},', '}}', '{"', '["', '],', '"},', '"],', '":"', '","', '"}}', '"]}']
VOCAB_SIZE = 1056          # the tokenizer's 1024 + the added tokens, padded as real checkpoints are

NL = "\\n"
_TOOLS_HERMES = (
    "{%- if tools %}"
    "{{- '<|im_start|>system" + NL + "' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '" + NL + NL + "' }}{%- endif %}"
    "{{- '# Tools" + NL + NL + "You may call one or more functions to assist with the user query." + NL + NL
    + "You are provided with function signatures within <tools></tools> XML tags:" + NL + "<tools>' }}"
    "{%- for tool in tools %}{{- '" + NL + "' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + NL + "</tools>" + NL + NL + "For each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:" + NL + "<tool_call>" + NL
    + "{\"name\": <function-name>, \"arguments\": <args-json-object>}" + NL + "</tool_call><|im_end|>" + NL + "' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system" + NL + "' + messages[0].content + '<|im_end|>" + NL + "' }}"
    "{%- endif %}"
)
# An assistant turn's end, a tool's answer (as a user turn, as Qwen's templates write it) and the loop's end.
_END_TURNS = (
    "{{- '<|im_end|>" + NL + "' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user" + NL + "<tool_response>" + NL + "' + message.content + '" + NL
    + "</tool_response><|im_end|>" + NL + "' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
_TURNS_HERMES = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user" + NL + "' + message.content + '<|im_end|>" + NL + "' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant" + NL + "' }}"
    "{%- if message.reasoning_content %}{{- '<think>" + NL + "' + message.reasoning_content + '" + NL
    + "</think>" + NL + NL + "' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- if loop.first and message.content %}{{- '" + NL + "' }}{%- endif %}"
    "{{- '<tool_call>" + NL + "{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{%- if tc.function.arguments is string %}{{- tc.function.arguments }}"
    "{%- else %}{{- tc.function.arguments | tojson }}{%- endif %}"
    "{{- '}" + NL + "</tool_call>' }}"
    "{%- endfor %}"
) + _END_TURNS
QWEN3_TEMPLATE = _TOOLS_HERMES + _TURNS_HERMES + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant" + NL + "' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>" + NL + NL + "</think>"
    + NL + NL + "' }}"
    "{%- elif open_think is defined and open_think %}{{- '<think>" + NL + "' }}{%- endif %}"
    "{%- endif %}"
)
QWEN3_THINKING_2507_TEMPLATE = (
    _TOOLS_HERMES + _TURNS_HERMES
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant" + NL + "<think>" + NL + "' }}{%- endif %}"
)
QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system" + NL + "' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '" + NL + NL + "' }}{%- endif %}"
    "{{- '# Tools" + NL + NL + "You have access to the following functions:" + NL + NL + "<tools>' }}"
    "{%- for tool in tools %}{%- set f = tool.function %}"
    "{{- '" + NL + "<function>" + NL + "<name>' + f.name + '</name>' }}"
    "{%- if f.description %}{{- '" + NL + "<description>' + f.description + '</description>' }}{%- endif %}"
    "{{- '" + NL + "<parameters>' }}"
    "{%- for pname, pfields in (f.parameters.properties or {}) | items %}"
    "{{- '" + NL + "<parameter>" + NL + "<name>' + pname + '</name>' }}"
    "{%- if pfields.type %}{{- '" + NL + "<type>' + (pfields.type | string) + '</type>' }}{%- endif %}"
    "{{- '" + NL + "</parameter>' }}"
    "{%- endfor %}"
    "{{- '" + NL + "</parameters>" + NL + "</function>' }}"
    "{%- endfor %}"
    "{{- '" + NL + "</tools>" + NL + NL + "If you choose to call a function ONLY reply in the following format with NO "
    "suffix:" + NL + NL + "<tool_call>" + NL + "<function=example_function_name>" + NL
    + "<parameter=example_parameter_1>" + NL + "value_1" + NL + "</parameter>" + NL + "</function>" + NL
    + "</tool_call><|im_end|>" + NL + "' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system" + NL + "' + messages[0].content + '<|im_end|>" + NL + "' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user" + NL + "' + message.content + '<|im_end|>" + NL + "' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant" + NL + "' + (message.content or '') }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{{- '" + NL + "<tool_call>" + NL + "<function=' + tc.function.name + '>" + NL + "' }}"
    "{%- if tc.function.arguments is mapping %}"
    "{%- for aname, avalue in tc.function.arguments | items %}"
    "{{- '<parameter=' + aname + '>" + NL + "' }}"
    "{%- if avalue is mapping or (avalue is sequence and avalue is not string) %}{{- avalue | tojson }}"
    "{%- else %}{{- avalue | string }}{%- endif %}"
    "{{- '" + NL + "</parameter>" + NL + "' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '</function>" + NL + "</tool_call>' }}"
    "{%- endfor %}"
) + _END_TURNS + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant" + NL + "' }}{%- endif %}"


def make_qwen3_chat_model(out_dir, seed: int = 0, template: str = QWEN3_TEMPLATE) -> str:
    from tokenizers import AddedToken, Tokenizer

    out = Path(make_tiny_model(out_dir, seed=seed, vocab_size=VOCAB_SIZE))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.save(str(out / "tokenizer.json"))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return str(out)
