"""Sampling parameters, shared by the core (which applies them) and the clients (which fill them in)."""
from __future__ import annotations

import msgspec


class ValidationError(ValueError):
    """A request field is out of range. `field` names it so a client can point at it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GUIDED_SPEC_CHARS = 1 << 20      # a schema, regex or grammar this long is a mistake, not a format
MAX_LOGIT_BIAS_ENTRIES = 1024


class GuidedDecoding(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """A grammar the output must match, enforced by the core with a token mask (vLLM's guided_* options).

    kind "json": `spec` is a JSON schema (as JSON text); "json_object": any JSON object (spec unused);
    "regex": a regular expression; "choice": `choices`, one of which is the whole output; "grammar": EBNF
    (GBNF dialect, rule `root`). `prefix` and `suffix` are literal text around the constrained part
    (e.g. a tool call's `<tool_call>` tags). Once the grammar is complete only an end-of-sequence token is
    allowed, and the request ends with "stop" even with ignore_eos.
    """
    kind: str
    spec: str = ""
    choices: list[str] = []
    prefix: str = ""
    suffix: str = ""

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


def _number_in(value, lo: float, hi: float) -> bool:
    """A real number (not a bool) in [lo, hi]; NaN and infinities fail."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Per-request sampling and stopping controls (vLLM's names and defaults).

    temperature 0 means greedy. top_k 0 or -1 disables top-k. `logprobs`: None for none, 0 for the
    sampled token's log-probability only, n for it plus the n most likely tokens. `stop` strings are
    matched by the client on detokenized text; the core never sees text.
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

    MAX_LOGPROBS = 20
    MAX_PENALTY = 2.0            # OpenAI's range for presence and frequency penalties: [-2, 2]
    MAX_REPETITION_PENALTY = 100.0
    MAX_LOGIT_BIAS = 100.0       # OpenAI's range for a bias: [-100, 100]

    def validate(self) -> "SamplingParams":
        """Raise ValidationError naming the first bad field; return self so calls can chain."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValidationError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValidationError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValidationError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValidationError("top_k", f"must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValidationError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValidationError("seed", f"must be in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValidationError("logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValidationError("stop_token_ids", "must be non-negative integers")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValidationError("stop", "must be non-empty strings")
        if not isinstance(self.speculative, bool):
            raise ValidationError("speculative", f"must be a boolean, got {self.speculative!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number_in(getattr(self, name), -self.MAX_PENALTY, self.MAX_PENALTY):
                raise ValidationError(name, f"must be a number in [-{self.MAX_PENALTY:g}, {self.MAX_PENALTY:g}], "
                                            f"got {getattr(self, name)!r}")
        if not (_number_in(self.repetition_penalty, 0.0, self.MAX_REPETITION_PENALTY) and self.repetition_penalty > 0):
            raise ValidationError("repetition_penalty", f"must be a number in (0, {self.MAX_REPETITION_PENALTY:g}], "
                                                        f"got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValidationError("logit_bias", f"has {len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**31:
                raise ValidationError("logit_bias", f"keys must be token ids in [0, 2**31), got {token!r}")
            if not _number_in(bias, -self.MAX_LOGIT_BIAS, self.MAX_LOGIT_BIAS):
                raise ValidationError("logit_bias", f"token {token}: bias must be a number in "
                                                    f"[-{self.MAX_LOGIT_BIAS:g}, {self.MAX_LOGIT_BIAS:g}], got {bias!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValidationError("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], "
                                                f"got {self.min_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValidationError("include_stop_str_in_output", "must be a boolean")
        if self.guided is not None:
            self.guided.validate()
        return self

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Anything beyond temperature and the top-k/top-p/min-p filters touches this request's logits."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.guided is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
