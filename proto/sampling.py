"""Sampling parameters, shared by the core (which applies them) and the clients (which fill them in)."""
from __future__ import annotations

import msgspec

from llmserve_proto.bounds import (INT32_MAX, INT64_MAX, Bool, Float, Int, IntList, StrList, ValidationError,
                                   check_fields)

__all__ = ["SamplingParams", "ValidationError", "GREEDY_EPSILON"]

# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32 (1e-40 is a
# float32 denormal), and the distribution it asks for is the argmax anyway.
GREEDY_EPSILON = 1e-5


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Per-request sampling and stopping controls (vLLM's names and defaults).

    temperature 0 (or below GREEDY_EPSILON) means greedy. top_k 0 or -1 disables top-k. `logprobs`: None
    for none, 0 for the sampled token's log-probability only, n for it plus the n most likely tokens.
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

    MAX_LOGPROBS = 20
    MAX_TEMPERATURE = 100.0      # past this the distribution is uniform to float32 precision anyway

    def validate(self) -> "SamplingParams":
        """Raise ValidationError naming the first bad field; return self so calls can chain.
        Context-dependent limits (max_model_len, the vocabulary) are the engine's to check."""
        check_fields(self, SAMPLING_BOUNDS)
        return self

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
}
