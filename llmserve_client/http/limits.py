"""What an HTTP peer may cost the frontend: a bounded body, read within a deadline, a request head that
arrives in time, and a prompt refused from its size before any tokenizing.

uvicorn reads a body only as fast as the app asks for it (it pauses the socket past 64 KiB), so a body is
never buffered beyond what BodyLimit has accepted. uvicorn's own keep-alive timer runs only between
requests and stops at the first byte of the next one, and a connection that never sends a byte has no
timer at all: HeadTimeoutH11Protocol closes any connection whose request head is not complete in time.

Prompt size: tokenizing is the one step whose cost grows with the request, and a request past
max_model_len is refused anyway, so such a request must be refused before it is tokenized, from what
decoding the body already tells: its characters and its message count. No honest prompt spells a token
with more than CHARS_PER_TOKEN characters on average, and each chat message costs the template at least
MESSAGE_TOKENS tokens, so a chat of m messages and c characters holds at least c / CHARS_PER_TOKEN + m *
MESSAGE_TOKENS tokens; at max_model_len or more it cannot fit.
"""
from __future__ import annotations

import asyncio
import json

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEAD_TIMEOUT_S = 10.0

# Qwen's tokenizer averages about 4 characters a token on English prose and 3 to 4 on code; runs of one
# character (rules of dashes, indentation) go up to a few dozen. 32 on average over a whole prompt leaves
# honest text a wide margin, and still refuses an 8 MB message at once for any context under 250k tokens.
CHARS_PER_TOKEN = 32
# Qwen3's ChatML spends 5 tokens on a message with empty content (<|im_start|>, role, newline, <|im_end|>,
# newline); 3 leaves room for any template as terse.
MESSAGE_TOKENS = 3


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


async def _reply_and_close(send, status: int, message: str, code: str) -> None:
    # Connection: close, because the rest of the body is never read: the connection cannot carry another
    # request, and closing it frees its file descriptor now.
    body = _error_body(message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: read each request body up front, at most max_bytes (413 past it, decided from
    Content-Length when there is one) and within timeout_s of the head (408 otherwise). The app then gets
    the whole body in one message, and later receive() calls (disconnect watching) go to the server."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await _reply_and_close(send, 408, f"the request body did not arrive within "
                                                         f"{self.timeout_s:g} s", "request_timeout")
            if message["type"] == "http.disconnect":
                return   # nobody is left to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._too_large(send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return whole
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        await _reply_and_close(send, 413, f"the request body is larger than the limit of {self.max_bytes} bytes",
                               "request_too_large")


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is incomplete head_timeout seconds
    after it opened or after the previous response ended."""

    head_timeout: float = DEFAULT_HEAD_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:   # the head is in: the body has BodyLimit's deadline
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """The protocol class to hand uvicorn.Config(http=...)."""
    return type("HeadTimeoutH11", (HeadTimeoutH11Protocol,), {"head_timeout": seconds})


def chars_per_token(longest_token_chars: int) -> int:
    """The characters one token stands for at most, on average: CHARS_PER_TOKEN, or less where the
    vocabulary's longest token is shorter (then that is a proof, not an estimate; 2x allows a normalizer
    that shrinks text, as composing characters does)."""
    return max(1, min(CHARS_PER_TOKEN, 2 * longest_token_chars))


class _Messages(msgspec.Struct):
    messages: list[msgspec.Raw] = []


_MESSAGES = msgspec.json.Decoder(_Messages)
# Bodies past this are counted first: a body of 8 MB can hold 500,000 tiny messages, which the full decode
# takes four times as long to build as this pass takes to count (both on the event loop: msgspec holds the
# GIL). Smaller bodies hold too few messages to matter.
COUNT_FIRST_BYTES = 1 << 20


def message_count(body: bytes) -> int | None:
    """The messages of a chat request body, counted without building them; None for a body that is not
    such JSON (the full decode says what is wrong with it)."""
    try:
        return len(_MESSAGES.decode(body).messages)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def chat_size(req) -> tuple[int, int]:
    """(characters, messages) of a chat request: every message's content (all roles, every text part), name,
    tool calls (names and arguments), tool_call_id and reasoning, plus the tools and template arguments the
    template renders. Cheap: it reads the decoded request, building nothing per message."""
    chars = 0
    for m in req.messages:
        content = m.content
        if isinstance(content, str):
            chars += len(content)
        elif content:
            chars += sum(len(p.text or "") for p in content)
        for text in (m.name, m.tool_call_id, m.reasoning_content):
            if text:
                chars += len(text)
        for call in m.tool_calls or ():
            args = call.function.arguments
            chars += len(call.function.name) + (len(args) if isinstance(args, str) else _json_chars(args))
    for extra in (req.tools, req.chat_template_kwargs):
        if extra:
            chars += _json_chars(extra)
    return chars, len(req.messages)


def fewest_tokens(chars: int, messages: int, per_token: int) -> int:
    """A lower bound on the tokens of a prompt of `chars` characters in `messages` chat messages (0 for a
    plain prompt), for honest text (see CHARS_PER_TOKEN)."""
    return chars // per_token + messages * MESSAGE_TOKENS


def _json_chars(value) -> int:
    try:
        return len(msgspec.json.encode(value))
    except (TypeError, msgspec.EncodeError):
        return len(str(value))
