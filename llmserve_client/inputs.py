"""Turning what a caller passes (text, token ids, chat messages, sampling keywords) into a request."""
from __future__ import annotations

import re
import uuid

import msgspec

from llmserve_proto import GuidedDecoding, SamplingParams, ValidationError
from llmserve_client.errors import RequestError



def load_tokenizer(path: str):
    from transformers import AutoTokenizer   # imported late: a token-ids-only client never pays for it
    return AutoTokenizer.from_pretrained(path)


def build_params(sampling: dict) -> SamplingParams:
    """SamplingParams from keyword arguments named like its fields; errors name the field."""
    known = set(SamplingParams.__struct_fields__)
    for k in sampling:
        if k not in known:
            raise RequestError(k, f"unknown sampling parameter; expected one of {', '.join(sorted(known))}")
    if isinstance(sampling.get("stop"), str):
        sampling = {**sampling, "stop": [sampling["stop"]]}
    if isinstance(sampling.get("guided"), dict):
        try:
            sampling = {**sampling, "guided": GuidedDecoding(**sampling["guided"])}
        except TypeError as e:
            raise RequestError("guided", str(e)) from None
    try:
        # A wire round trip type-checks every field exactly as the core will.
        params = _roundtrip(SamplingParams(**sampling))
    except OverflowError:
        field = next((k for k, v in sampling.items() if _out_of_wire_range(v)), "params")
        raise RequestError(field, "holds an integer outside [-2**63, 2**64)") from None
    except msgspec.ValidationError as e:
        m = re.search(r"at `\$\[(\d+)\]", str(e))
        field = SamplingParams.__struct_fields__[int(m.group(1))] if m else "params"
        raise RequestError(field, str(e).split(" - at ")[0]) from None
    try:
        return params.validate()
    except ValidationError as e:
        raise RequestError(e.field, e.message) from None


def _out_of_wire_range(value) -> bool:
    """msgpack carries integers in [-2**63, 2**64) only (also as map keys)."""
    if isinstance(value, int):
        return not -2**63 <= value < 2**64
    if isinstance(value, dict):
        return any(_out_of_wire_range(k) or _out_of_wire_range(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_out_of_wire_range(v) for v in value)
    return False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SamplingParams)


def _roundtrip(params: SamplingParams) -> SamplingParams:
    return _decoder.decode(_encoder.encode(params))


def to_token_ids(prompt, tokenizer_getter) -> list[int]:
    """str -> tokenized; list[int] -> as is; list of {"role", "content"} dicts -> the chat template."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "must not be empty")
        return list(tokenizer_getter().encode(prompt))
    if isinstance(prompt, (list, tuple)) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if all(isinstance(m, dict) for m in prompt):
            tok = tokenizer_getter()
            if not getattr(tok, "chat_template", None):
                raise RequestError("messages", "the tokenizer has no chat template")
            ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
    raise RequestError("prompt", "must be a non-empty string, a list of token ids or a list of chat messages")


def new_request_id() -> str:
    return uuid.uuid4().hex
