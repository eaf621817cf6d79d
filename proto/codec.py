"""The one place messages become bytes and back (msgpack via msgspec; no pickle anywhere).

Encoders/decoders are kept per thread: the core encodes on its output thread and decodes on its
socket thread, a client on its caller and transport threads.
"""
from __future__ import annotations

import itertools
import re
import threading
import types
import typing

import msgspec

from llmserve_proto.messages import ClientMessage, CoreMessage

# A frame larger than this is refused by the socket itself (ZMQ_MAXMSGSIZE on the core).
MAX_FRAME_BYTES = 64 * 1024 * 1024

_local = threading.local()


def _codecs():
    c = getattr(_local, "codecs", None)
    if c is None:
        c = _local.codecs = (
            msgspec.msgpack.Encoder(),
            msgspec.msgpack.Decoder(ClientMessage),
            msgspec.msgpack.Decoder(CoreMessage),
            msgspec.msgpack.Decoder(),
        )
    return c


def encode(msg: msgspec.Struct) -> bytes:
    return _codecs()[0].encode(msg)


def decode_client(frame: bytes | memoryview):
    """bytes -> one of ClientMessage. Raises msgspec.DecodeError/ValidationError on bad input."""
    return _codecs()[1].decode(frame)


def decode_core(frame: bytes | memoryview):
    """bytes -> one of CoreMessage."""
    return _codecs()[2].decode(frame)


class BadMessage(Exception):
    """A client frame that could not be decoded. `request_id` is set when one could be recovered, so
    the error can be routed to that request; `field` names the offending field when known."""

    def __init__(self, message: str, request_id: str | None = None, field: str = ""):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.field = field


def _field_path(struct_type, indices: list[int]) -> str:
    """Map msgspec's array path ($[3][1]) to field names (params.temperature) for array_like structs."""
    names: list[str] = []
    t = struct_type
    for i in indices:
        fields = getattr(t, "__struct_fields__", None)
        if fields is None:
            names.append(f"[{i}]")
            continue
        offset = 1 if getattr(t, "__struct_config__").tag is not None else 0
        j = i - offset
        if not 0 <= j < len(fields):
            break
        name = fields[j]
        names.append(name)
        t = _struct_field_type(t, name)
    return ".".join(names).replace(".[", "[")


def _struct_field_type(t, name):
    hint = typing.get_type_hints(t).get(name)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):     # an optional struct: GuidedDecoding | None
        hint = next((h for h in typing.get_args(hint) if h is not type(None)), None)
    return hint if isinstance(hint, type) and hasattr(hint, "__struct_fields__") else None


_TAGS = {cls.__struct_config__.tag: cls for cls in ClientMessage.__args__}


def decode_client_checked(frame: bytes | memoryview):
    """decode_client, but failures become BadMessage naming the request and field where possible."""
    try:
        return decode_client(frame)
    except msgspec.ValidationError as e:
        raw = _salvage(frame)
        # Any JSON-like value may sit where the tag goes (a list is unhashable): only a string is a tag.
        tag = raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], str) else None
        rid = raw[1] if tag in ("generate", "pool") and len(raw) > 1 and isinstance(raw[1], str) else None
        field = ""
        if tag in _TAGS:
            # A request_error with no field says the request was fine (retry it): name one whenever msgspec
            # says where. Its path ends at a map ("`key` in `$[3][14]`", "`$[3][14][...]`"), and an array
            # that is too short is missing the element at the length it has.
            path = re.search(r"`\$((?:\[(?:\d+|\.\.\.)\])*)`", str(e))
            steps = re.findall(r"\[(\d+|\.\.\.)\]", path.group(1)) if path else []
            indices = [int(i) for i in itertools.takewhile(str.isdigit, steps)]
            short = re.match(r"Expected `array` of at least length \d+, got (\d+)", str(e))
            if short:
                indices.append(int(short.group(1)))
            if indices:
                # Sampling (and pooling) fields are named bare ("temperature"), as validate() names them.
                field = _field_path(_TAGS[tag], indices).removeprefix("params.")
        raise BadMessage(f"invalid message: {e}", rid, field) from None
    except msgspec.DecodeError as e:
        raise BadMessage(f"malformed frame: {e}") from None


def _salvage(frame):
    try:
        return _codecs()[3].decode(frame)
    except Exception:
        return None
