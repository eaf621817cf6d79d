"""What the daemon's threads hand each other through queues (never over the wire)."""
from __future__ import annotations

from dataclasses import dataclass

from llmserve_proto import Generate, Pool

# socket thread -> busy loop


@dataclass
class NewRequest:
    client: bytes
    msg: Generate | Pool
    arrival_time: float


@dataclass
class AbortRequests:
    client: bytes
    request_ids: list[str]


@dataclass
class ClientGone:
    client: bytes
    reason: str


@dataclass
class StatsQuery:
    client: bytes
    nonce: int


@dataclass
class SocketFailed:
    """The socket thread or the output thread failed (the latter puts it too): no client can be served."""
    reason: str


# compile thread -> busy loop


@dataclass
class GrammarReady:
    """A grammar finished compiling (or failed to): a loop asleep while its requests waited for it wakes."""


# busy loop -> output thread


@dataclass
class StepResult:
    step: int
    time: float
    # (client, client's request id, StepOutput, RequestMetrics on the final output else None)
    items: list[tuple]


@dataclass
class ErrorReply:
    client: bytes
    request_id: str
    field: str
    message: str


@dataclass
class StatsResult:
    client: bytes
    nonce: int
    stats: dict


@dataclass
class Broadcast:
    """A message for every connected client (Shutdown, fatal EngineError); `last` ends the output thread."""
    msg: object
    last: bool = False
