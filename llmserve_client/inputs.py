"""Turning what a caller passes (text, token ids, chat messages, sampling keywords) into a request."""
from __future__ import annotations

import re
import threading
import uuid

import msgspec

from llmserve_proto import GuidedDecoding, SamplingParams, ValidationError
from llmserve_client.errors import RequestError



INT64_MIN, UINT64_LIMIT = -2**63, 2**64    # what a MessagePack integer can carry
MAX_TOKEN_ID = 2**63 - 1

# transformers' lazy module is not safe to import from several threads at once (a racing thread can see
# "cannot import name 'AutoTokenizer'"), so every load in the process goes through this lock.
_TOKENIZER_IMPORT = threading.Lock()


def load_tokenizer(path: str):
    with _TOKENIZER_IMPORT:
        from transformers import AutoTokenizer   # imported late: a token-ids-only client never pays for it
        return AutoTokenizer.from_pretrained(path)


def build_params(sampling: dict, detokenize: bool = True) -> SamplingParams:
    """SamplingParams from keyword arguments named like its fields; errors name the field. Stop strings are
    matched on the detokenized text, so a request without detokenize may not ask for them."""
    known = set(SamplingParams.__struct_fields__)
    for k in sampling:
        if k not in known:
            raise RequestError(k, f"unknown sampling parameter; expected one of {', '.join(sorted(known))}")
    if isinstance(sampling.get("stop"), str):
        sampling = {**sampling, "stop": [sampling["stop"]]}
    for name, value in _named_values(sampling):
        if _has_wide_int(value):
            raise RequestError(name, f"integer out of range: must be in [-2**63, 2**64), got {_short(value)}")
    if isinstance(sampling.get("guided"), dict):
        try:
            sampling = {**sampling, "guided": GuidedDecoding(**sampling["guided"])}
        except TypeError as e:
            raise RequestError("guided", str(e)) from None
    try:
        # A wire round trip type-checks every field exactly as the core will.
        params = _roundtrip(SamplingParams(**sampling))
    except OverflowError:
        field = next((k for k, v in sampling.items() if _has_wide_int(v)), "params")
        raise RequestError(field, "holds an integer outside [-2**63, 2**64)") from None
    except msgspec.ValidationError as e:
        # The path names the field by position: "at `$[14][...]`", or "at `key` in `$[14]`" for a map key.
        m = re.search(r"at (?:`key` in )?`\$\[(\d+)\]", str(e))
        field = SamplingParams.__struct_fields__[int(m.group(1))] if m else "params"
        message = str(e).split(" - at ")[0] + (" (a key)" if " - at `key` in " in str(e) else "")
        raise RequestError(field, message) from None
    try:
        params = params.validate()
    except ValidationError as e:
        raise RequestError(e.field, e.message) from None
    if params.stop and not detokenize:
        raise RequestError("stop", "stop strings need detokenize=True")
    return params


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
            return check_token_ids(list(prompt))
        if all(isinstance(m, dict) for m in prompt):
            tok = tokenizer_getter()
            if not getattr(tok, "chat_template", None):
                raise RequestError("messages", "the tokenizer has no chat template")
            ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
    raise RequestError("prompt", "must be a non-empty string, a list of token ids or a list of chat messages")


def check_token_ids(ids: list[int]) -> list[int]:
    """Token ids a message can carry (the core checks them against the vocabulary)."""
    for i, t in enumerate(ids):
        if not 0 <= t <= MAX_TOKEN_ID:
            raise RequestError("prompt_token_ids", f"token id {_short(t)} at index {i} is out of range")
    return ids


def _named_values(sampling: dict):
    """(field, value) pairs, a grammar's own fields named inside it ("guided.start_after")."""
    for name, value in sampling.items():
        if isinstance(value, msgspec.Struct):
            value = msgspec.structs.asdict(value)
        if name == "guided" and isinstance(value, dict):
            yield from ((f"{name}.{k}", v) for k, v in value.items())
        else:
            yield name, value


def _has_wide_int(value) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return not INT64_MIN <= value < UINT64_LIMIT
    if isinstance(value, dict):      # logit_bias: msgpack carries map keys in the same range
        return any(_has_wide_int(k) or _has_wide_int(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_wide_int(v) for v in value)
    return False


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def new_request_id() -> str:
    return uuid.uuid4().hex
