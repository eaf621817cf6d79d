"""Sampling parameters, shared by the core (which applies them) and the clients (which fill them in)."""
from __future__ import annotations

import msgspec

from llmserve_proto.bounds import (INT32_MAX, INT64_MAX, Bool, Float, Int, IntFloatMap, IntList, Nested, StrList,
                                   ValidationError, check_fields)

__all__ = ["SamplingParams", "ValidationError", "GREEDY_EPSILON"]

# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32 (1e-40 is a
# float32 denormal), and the distribution it asks for is the argmax anyway.
GREEDY_EPSILON = 1e-5


GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GUIDED_SPEC_CHARS = 1 << 20      # a schema, regex or grammar this long is a mistake, not a format
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_GUIDED_START_AFTER = 16          # token ids of an end-of-reasoning marker such as `</think>`


class GuidedDecoding(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """A grammar the output must match, enforced by the core with a token mask (vLLM's guided_* options).

    kind "json": `spec` is a JSON schema (as JSON text); "json_object": any JSON object (spec unused);
    "regex": a regular expression; "choice": `choices`, one of which is the whole output; "grammar": EBNF
    (GBNF dialect, rule `root`). `prefix` and `suffix` are literal text around the constrained part
    (e.g. a tool call's `<tool_call>` tags). Once the grammar is complete only an end-of-sequence token is
    allowed, and the request ends with "stop" even with ignore_eos.

    `start_after`: token ids (e.g. of `</think>`) the output must show before the grammar holds: tokens up
    to and including the first occurrence of this sequence in the generated tokens are the model's own
    (it may think freely), the grammar constrains the rest. Only generated tokens count, never the prompt:
    the client, which knows whether its prompt already closed the reasoning, leaves it empty then.
    """
    kind: str
    spec: str = ""
    choices: list[str] = []
    prefix: str = ""
    suffix: str = ""
    start_after: list[int] = []

    def validate(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValidationError("guided.kind", f"must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}")
        sizes = len(self.spec) + len(self.prefix) + len(self.suffix) + sum(len(c) for c in self.choices)
        if sizes > MAX_GUIDED_SPEC_CHARS:
            raise ValidationError(f"guided.{self.kind}", f"is {sizes} characters, at most {MAX_GUIDED_SPEC_CHARS}")
        if self.kind in ("json", "regex", "grammar") and not self.spec:
            raise ValidationError(f"guided.{self.kind}", "must not be empty")
        if self.kind == "choice" and (not self.choices or any(c == "" for c in self.choices)):
            raise ValidationError("guided.choice", "must be a non-empty list of non-empty strings")
        IntList(0, INT32_MAX, max_len=MAX_GUIDED_START_AFTER).check("guided.start_after", self.start_after)


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Per-request sampling and stopping controls (vLLM's names and defaults).

    temperature 0 (or below GREEDY_EPSILON) means greedy. top_k 0 or -1 disables top-k. `logprobs`: None
    for none, 0 for the sampled token's log-probability only, n for it plus the n most likely tokens.
    `prompt_logprobs` asks the same of every prompt token after the first (each given the tokens before it);
    the request's first output carries them all. Both report the model's own distribution (before
    temperature, penalties and filters), as vLLM does.
    `stop` strings are matched by the client on detokenized text; the core never sees text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: list[str] = []
    speculative: bool = True     # draft with EAGLE-3 when the core has a draft model; False opts out
    # Logits processing (vLLM's semantics). Penalties count output tokens only; repetition_penalty also
    # counts the prompt's: a token already seen has a positive logit divided by it, a negative one
    # multiplied. logit_bias (token id -> bias added to the logit) is applied first, penalties next.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0          # end-of-sequence and stop_token_ids are blocked until this many outputs
    include_stop_str_in_output: bool = False   # the client keeps a matched stop string in the text
    guided: GuidedDecoding | None = None
    prompt_logprobs: int | None = None   # as logprobs, for each prompt token after the first

    MAX_LOGPROBS = 20
    MAX_TEMPERATURE = 100.0      # past this the distribution is uniform to float32 precision anyway
    MAX_PENALTY = 2.0            # OpenAI's range for presence and frequency penalties: [-2, 2]
    MAX_REPETITION_PENALTY = 100.0
    MAX_LOGIT_BIAS = 100.0       # OpenAI's range for a bias: [-100, 100]

    def validate(self) -> "SamplingParams":
        """Raise ValidationError naming the first bad field; return self so calls can chain.
        Context-dependent limits (max_model_len, the vocabulary) are the engine's to check."""
        check_fields(self, SAMPLING_BOUNDS)
        if self.min_tokens > self.max_tokens:
            raise ValidationError("min_tokens", f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        return self

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def edits_logits(self) -> bool:
        """Penalties, biases or min_tokens: edits to every step's logits (a grammar masks only its part)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def processes_logits(self) -> bool:
        """Anything beyond temperature and the top-k/top-p/min-p filters touches this request's logits."""
        return self.edits_logits or self.guided is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


# One entry per field, in field order: a new field adds its line here (test_protocol checks every field has
# one). The bounds are what the core's tensors hold: top_k and counts fit int32, seeds and token ids int64,
# floats are finite.
SAMPLING_BOUNDS = {
    "max_tokens": Int(1, INT32_MAX),
    "temperature": Float(0.0, SamplingParams.MAX_TEMPERATURE),
    "top_p": Float(0.0, 1.0, lo_open=True),
    "top_k": Int(-1, INT32_MAX),
    "min_p": Float(0.0, 1.0),
    "seed": Int(0, INT64_MAX, optional=True),
    "stop_token_ids": IntList(0, INT64_MAX, max_len=1024),
    "ignore_eos": Bool(),
    "logprobs": Int(0, SamplingParams.MAX_LOGPROBS, optional=True),
    "stop": StrList(max_len=256, max_chars=4096),
    "speculative": Bool(),
    "presence_penalty": Float(-SamplingParams.MAX_PENALTY, SamplingParams.MAX_PENALTY),
    "frequency_penalty": Float(-SamplingParams.MAX_PENALTY, SamplingParams.MAX_PENALTY),
    "repetition_penalty": Float(0.0, SamplingParams.MAX_REPETITION_PENALTY, lo_open=True),
    "logit_bias": IntFloatMap(0, INT32_MAX, -SamplingParams.MAX_LOGIT_BIAS, SamplingParams.MAX_LOGIT_BIAS,
                              max_len=MAX_LOGIT_BIAS_ENTRIES),
    "min_tokens": Int(0, INT32_MAX),          # and at most max_tokens (validate)
    "include_stop_str_in_output": Bool(),
    "guided": Nested(GuidedDecoding, optional=True),
    "prompt_logprobs": Int(0, SamplingParams.MAX_LOGPROBS, optional=True),
}
