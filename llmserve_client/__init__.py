"""llmserve_client: thin clients of llmserve-core (tokenize, send token ids, detokenize streamed outputs).

    from llmserve_client import Client
    with Client() as c:                               # default endpoint; or Client("ipc:///path"), or a list
                                                      # of endpoints to serve over several cores
        print(c.generate("Hello", max_tokens=32, temperature=0).text)
        for chunk in c.stream([{"role": "user", "content": "Hi"}], max_tokens=64):
            print(chunk.text, end="", flush=True)

Never imports torch or the core.
"""
from llmserve_client.async_client import AsyncClient, AsyncStream
from llmserve_client.client import Client, Stream
from llmserve_client.detokenizer import IncrementalDetokenizer
from llmserve_client.errors import (EngineDeadError, HandshakeTimeoutError, LLMServeError, ModelChangedError,
                                    ModelMismatchError, ProtocolError, RequestError)
from llmserve_client.types import Completion, Embeddings, Logprobs, ModelInfo, Scores, StreamChunk, Timings, Usage


def run(main):
    """Run a coroutine on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        import asyncio
        return asyncio.run(main)
    return uvloop.run(main)


__all__ = [
    "Client", "Stream", "AsyncClient", "AsyncStream", "Completion", "StreamChunk", "Usage", "Timings",
    "Embeddings", "Scores",
    "Logprobs", "ModelInfo", "IncrementalDetokenizer", "LLMServeError", "EngineDeadError",
    "HandshakeTimeoutError", "ModelChangedError", "ModelMismatchError", "ProtocolError", "RequestError", "run",
]
