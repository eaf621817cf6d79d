"""Results handed to users of the client library."""
from __future__ import annotations

from dataclasses import dataclass, field

from llmserve_proto import Logprobs, ModelInfo

__all__ = ["Completion", "StreamChunk", "Usage", "Timings", "Logprobs", "ModelInfo", "Embeddings", "Scores"]


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0           # prompt tokens served from the engine's prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    """All times are time.monotonic() seconds. The core_* ones come from the core's clock: on the same
    host (ipc, or tcp to localhost) they are directly comparable with the client's."""
    sent: float = 0.0                        # client handed the request to its socket
    first_chunk: float | None = None         # client received the first token
    done: float | None = None                # client received the final output
    token_times: list[float] = field(default_factory=list)   # client receive time of each output token
    core_arrival: float | None = None        # core received the request
    core_first_token: float | None = None
    core_finish: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token as the client saw it."""
        return None if self.first_chunk is None else self.first_chunk - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def itl(self) -> list[float]:
        """Inter-token gaps at the client (tokens arriving in one message count as gap 0)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class StreamChunk:
    """What one step produced for a streamed request. `text` is new text only; concatenating every
    chunk's text gives Completion.text. The final chunk has finish_reason set (and usage, timings).
    prompt_logprobs (asked for with the prompt_logprobs keyword) come with the first chunk only: one per
    prompt token, as vLLM gives them (None for the first, which has nothing before it)."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None         # None | "stop" | "length" | "abort"
    stop_reason: str | int | None = None     # the stop string or stop token id that ended it, if any
    logprobs: list[Logprobs] | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    timings: Timings
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None     # one per prompt token: None for the first


@dataclass
class Embeddings:
    """Client.embed's answer: one vector per input, in input order."""
    embeddings: list[list[float]]
    raw: list[bytes]                 # the same vectors as float32 little-endian bytes (what base64 encodes)
    usage: Usage


@dataclass
class Scores:
    """Client.score's answer, one entry per document in order: p(yes) = sigmoid(logit("yes") - logit("no"))
    (the reranker's relevance score) and the log-odds themselves."""
    scores: list[float]
    logits: list[float]
    usage: Usage
