"""Exceptions a client call can raise."""
from __future__ import annotations


class LLMServeError(Exception):
    """Base of every llmserve_client error."""


class EngineDeadError(LLMServeError):
    """The core is gone (killed, crashed, shut down, or silent past the heartbeat timeout). Every call that
    was waiting on it raises this, and so does every new call until a core answers again on the endpoint:
    the client reconnects by itself (unless made with reconnect=False) and then serves again."""


class HandshakeTimeoutError(EngineDeadError):
    """No core answered the handshake at the endpoint within connect_timeout."""


class ModelChangedError(EngineDeadError):
    """The core that came back on the endpoint serves another model than the one this client started with.
    The client stops trying: make a new one."""


class ModelMismatchError(LLMServeError):
    """A client or frontend over several cores found them serving different models at connect time."""


class ProtocolError(LLMServeError):
    """The core speaks another protocol version, or sent something this client cannot read."""


class RequestError(LLMServeError, ValueError):
    """The core (or the client's own checks) rejected a request. `field` names the offending input,
    e.g. "params.temperature" or "prompt_token_ids"."""

    def __init__(self, field: str, message: str, request_id: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message
        self.request_id = request_id
