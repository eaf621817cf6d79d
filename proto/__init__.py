"""llmserve wire protocol: the only contract between llmserve-core and its clients.

Import name `llmserve_proto` (the folder is `proto/`). Nothing here imports torch. PROTOCOL.md
describes sockets, framing, message order and error semantics.
"""
from llmserve_proto.sampling import GuidedDecoding, SamplingParams, ValidationError
from llmserve_proto.pooling import PoolingParams
from llmserve_proto.messages import (
    FINISH_REASONS, PROTOCOL_VERSION, Abort, ClientMessage, CoreMessage, EngineError, Generate, Goodbye,
    Heartbeat, Hello, Logprobs, ModelInfo, OutputBatch, Ping, Pool, PooledBatch, PoolingOutput, RequestError,
    RequestMetrics, RequestOutput, Shutdown, StatsReply, StatsRequest, Welcome,
)
from llmserve_proto.codec import BadMessage, decode_client, decode_client_checked, decode_core, encode
from llmserve_proto.endpoint import default_endpoint

__all__ = [
    "SamplingParams", "GuidedDecoding", "PoolingParams", "ValidationError", "PROTOCOL_VERSION", "FINISH_REASONS",
    "Hello", "Generate", "Pool", "Abort", "StatsRequest", "Ping", "Goodbye", "ClientMessage",
    "ModelInfo", "Welcome", "Logprobs", "RequestMetrics", "RequestOutput", "OutputBatch", "PoolingOutput",
    "PooledBatch", "RequestError", "EngineError", "StatsReply", "Heartbeat", "Shutdown", "CoreMessage",
    "encode", "decode_client", "decode_client_checked", "decode_core", "BadMessage", "default_endpoint",
]
