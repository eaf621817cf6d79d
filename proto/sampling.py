"""Sampling parameters, shared by the core (which applies them) and the clients (which fill them in)."""
from __future__ import annotations

import msgspec


class ValidationError(ValueError):
    """A request field is out of range. `field` names it so a client can point at it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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

    MAX_LOGPROBS = 20

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
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
