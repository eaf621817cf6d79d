"""Messages between llmserve-core and its clients (see PROTOCOL.md for sockets, order and semantics).

Every message is a msgspec Struct encoded as one msgpack array whose first element is the tag string
(`array_like=True`, `tag=...`). Fields may only ever be appended at the end, with a default, so an
older peer can still decode a newer message (trailing defaults are omitted on the wire).
"""
from __future__ import annotations

import sys

import msgspec

from llmserve_proto.bounds import INT32_MAX, INT64_MAX, INT64_MIN, Float, Int, IntList, Str, StrList, check_fields
from llmserve_proto.pooling import PoolingParams
from llmserve_proto.sampling import SamplingParams

PROTOCOL_VERSION = 1

FINISH_REASONS = ("stop", "length", "abort")


def _msg(tag: str):
    """Struct options shared by every wire message."""
    return dict(tag=tag, array_like=True, omit_defaults=True, kw_only=True)


# ---------------------------------------------------------------- client -> core

class Hello(msgspec.Struct, **_msg("hello")):
    """First message of a session. The core answers with Welcome once the model is loaded."""
    protocol_version: int = PROTOCOL_VERSION
    client_name: str = ""


class Generate(msgspec.Struct, **_msg("generate")):
    """Start one request. `request_id` is chosen by the client and unique among its live requests."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # Who the request is for, inside this connection: the core shares its slots fairly between (connection,
    # user) pairs, so a frontend serving many users over one connection passes each request's user on.
    user: str = ""


class Pool(msgspec.Struct, **_msg("pool")):
    """Start one pooling request: run the prompt only and answer with one PoolingOutput (an embedding or
    the named tokens' logits), in a PooledBatch. Request ids share one namespace with Generate's."""
    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams = msgspec.field(default_factory=PoolingParams)
    user: str = ""                   # as Generate's: whom the request is for, for the core's fair shares


class Abort(msgspec.Struct, **_msg("abort")):
    """Stop requests early; each live one gets a final output with finish_reason "abort"."""
    request_ids: list[str]


class StatsRequest(msgspec.Struct, **_msg("stats")):
    """Ask for engine counters; answered by StatsReply carrying the same nonce."""
    nonce: int = 0


class Ping(msgspec.Struct, **_msg("ping")):
    """Client heartbeat. A client silent for longer than Welcome.client_timeout_s is treated as gone."""
    time: float = 0.0


class Goodbye(msgspec.Struct, **_msg("goodbye")):
    """Client is closing: abort its live requests and forget it."""


ClientMessage = Hello | Generate | Pool | Abort | StatsRequest | Ping | Goodbye

MAX_REQUEST_ID_LEN = 256
MAX_USER_LEN = 256

# Bounds of every client -> core field (see bounds.py), one table per message. client_name is not bounded
# here: a long one is truncated for display, never refused. Vocabulary and max_model_len limits are the
# core's to add, as it alone knows them.
CLIENT_BOUNDS = {
    Hello: {"protocol_version": Int(INT64_MIN, INT64_MAX)},
    Generate: {"request_id": Str(MAX_REQUEST_ID_LEN, min_chars=1),
               "prompt_token_ids": IntList(0, INT64_MAX, max_len=INT32_MAX, min_len=1),
               "user": Str(MAX_USER_LEN)},
    Pool: {"request_id": Str(MAX_REQUEST_ID_LEN, min_chars=1),
           "prompt_token_ids": IntList(0, INT64_MAX, max_len=INT32_MAX, min_len=1),
           "user": Str(MAX_USER_LEN)},
    Abort: {"request_ids": StrList(max_len=65536, max_chars=MAX_REQUEST_ID_LEN)},
    StatsRequest: {"nonce": Int(INT64_MIN, INT64_MAX)},
    Ping: {"time": Float(-sys.float_info.max, sys.float_info.max)},
    Goodbye: {},
}


def validate_client_message(msg) -> None:
    """Raise ValidationError naming the first out-of-bounds field of a decoded client message (sampling
    fields are named bare, e.g. "temperature", as SamplingParams.validate() names them; pooling fields
    likewise, e.g. "dimensions")."""
    check_fields(msg, CLIENT_BOUNDS[type(msg)])
    if isinstance(msg, (Generate, Pool)):
        msg.params.validate()


# ---------------------------------------------------------------- core -> client

class ModelInfo(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """What a client needs to know about the served model."""
    model: str                       # model directory (tokenizer lives there) as the core was given it
    name: str = ""                   # short display name (directory base name)
    vocab_size: int = 0
    max_model_len: int = 0
    eos_token_ids: list[int] = []
    speculative: bool = False        # EAGLE-3 speculative decoding is on
    speculative_model: str | None = None
    tokenizer: str | None = None     # tokenizer directory when it differs from `model`
    # What the core serves: runner "generate" or "pooling" (prompts only: embed and score), the request
    # kinds it takes ("generate", "embed", "score"; empty from a core older than pooling requests: only
    # "generate"), and the width of an embedding.
    runner: str = "generate"
    tasks: list[str] = []
    hidden_size: int = 0


class Welcome(msgspec.Struct, **_msg("welcome")):
    """Answer to Hello: the engine is loaded and accepts requests from now on."""
    protocol_version: int
    model_info: ModelInfo
    heartbeat_interval_s: float      # the core sends Heartbeat at least this often
    client_timeout_s: float          # the core drops a client silent for this long (send Ping well within it)
    core_pid: int = 0
    max_request_tokens: int = 0      # prompt + max_tokens may not exceed this (max_model_len, or less on a small KV pool)
    kv_block_size: int = 0           # tokens per KV block: prompts sharing their first block share cached KV


class Logprobs(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Log-probabilities at one generated (or prompt) position."""
    logprob: float                   # of the sampled (or prompt) token
    top_token_ids: list[int] = []    # the n most likely tokens (n = logprobs or prompt_logprobs), best first
    top_logprobs: list[float] = []


class RequestMetrics(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Per-request accounting, sent with the request's final output. Times are the core's
    time.monotonic() (CLOCK_MONOTONIC: comparable with a client's on the same host)."""
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0       # prompt tokens served from the prefix cache
    num_generated_tokens: int = 0


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """New tokens of one request from one engine step. finish_reason set = last output of the request."""
    request_id: str
    token_ids: list[int] = []
    finish_reason: str | None = None          # None | "stop" | "length" | "abort"
    logprobs: list[Logprobs] | None = None    # one per token in token_ids when requested
    metrics: RequestMetrics | None = None     # only on the final output
    # With params.prompt_logprobs, on the request's first output only (the one bringing its first token):
    # one per prompt token after the first, in order (the first prompt token has nothing before it).
    prompt_logprobs: list[Logprobs] | None = None


class OutputBatch(msgspec.Struct, **_msg("outputs")):
    """Everything one engine step produced for one client."""
    outputs: list[RequestOutput]
    step: int = 0
    time: float = 0.0                # core monotonic time the step finished


class PoolingOutput(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """The one and final answer to a Pool request."""
    request_id: str
    embedding: bytes = b""            # embed: float32 little-endian, `dimensions` (else hidden_size) values
    logits: list[float] = []          # score: the last position's logit of each params.token_ids, in order
    finish_reason: str = "stop"       # "stop": computed; "abort": aborted before it was (nothing above)
    metrics: RequestMetrics | None = None


class PooledBatch(msgspec.Struct, **_msg("pooled")):
    """The pooling requests one engine step finished for one client."""
    outputs: list[PoolingOutput]
    step: int = 0
    time: float = 0.0


class RequestError(msgspec.Struct, **_msg("request_error")):
    """A request was rejected (or failed). It is finished: no further output for this id."""
    request_id: str
    field: str                       # offending field, e.g. "params.temperature", "prompt_token_ids"
    message: str


class EngineError(msgspec.Struct, **_msg("engine_error")):
    """A message not tied to a request: malformed frame, protocol violation, or engine failure.
    fatal=True: the core is going away (or has dropped this client); every live request is lost."""
    message: str
    fatal: bool = False


class StatsReply(msgspec.Struct, **_msg("stats_reply")):
    nonce: int
    stats: dict[str, int | float | str | bool | None]


class Heartbeat(msgspec.Struct, **_msg("heartbeat")):
    """Core liveness, sent to every known client at least every heartbeat_interval_s."""
    time: float = 0.0


class Shutdown(msgspec.Struct, **_msg("shutdown")):
    """The core is exiting (after draining). Sent once; the session is over."""
    reason: str = ""


CoreMessage = Welcome | OutputBatch | PooledBatch | RequestError | EngineError | StatsReply | Heartbeat | Shutdown
