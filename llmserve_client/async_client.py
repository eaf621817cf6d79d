"""AsyncClient: the asyncio client library. It runs on any loop; `llmserve_client.run(main())` picks uvloop
when it is installed. It shares the sync client's transport thread and request logic; outputs
cross into the event loop with call_soon_threadsafe."""
from __future__ import annotations

import asyncio
import collections
import threading
import weakref
from collections.abc import AsyncIterator

from llmserve_proto import ModelInfo, PoolingOutput, PoolingParams
from llmserve_client import pooling
from llmserve_client.cores import Cores, aggregate_stats, endpoint_list
from llmserve_client.errors import LLMServeError
from llmserve_client.inputs import build_params, check_token_ids, load_tokenizer, new_request_id, to_token_ids
from llmserve_client.request_stream import RequestStream
from llmserve_client.transport import Transport
from llmserve_client.types import Completion, Embeddings, Scores, StreamChunk


class _LoopBridge:
    """Hands items from the transport thread to queues owned by one event loop, waking the loop once per
    burst (an engine step's outputs for many requests) rather than once per item."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: collections.deque = collections.deque()
        self._scheduled = False

    def put(self, queue: asyncio.Queue, item) -> None:
        self._pending.append((queue, item))
        if not self._scheduled:
            self._scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:
                pass   # the loop is closed: nobody is waiting any more

    def _flush(self) -> None:
        # Reset before draining: an item appended after this line either is drained below or schedules
        # another flush.
        self._scheduled = False
        pending = self._pending
        while pending:
            queue, item = pending.popleft()
            queue.put_nowait(item)


class _LoopSink:
    """A sink (see transport.py) feeding an asyncio.Queue through the loop's bridge."""

    def __init__(self, bridge: _LoopBridge):
        self.bridge = bridge
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        self.bridge.put(self.queue, item)


def _bridge_for(loop: asyncio.AbstractEventLoop, bridges: dict) -> _LoopBridge:
    b = bridges.get(loop)
    if b is None:
        b = bridges[loop] = _LoopBridge(loop)
    return b


class AsyncClient:
    """Async twin of Client. Use `async with AsyncClient(endpoint) as c:` or `await c.connect()`; every method
    also connects on first use. Same arguments as Client."""

    def __init__(self, endpoint: str | list[str] | None = None, *, tokenizer=None, connect_timeout: float = 60.0,
                 heartbeat_timeout: float = 5.0, client_name: str = "", reconnect: bool = True):
        self.endpoints = endpoint_list(endpoint)
        self.endpoint = self.endpoints[0]
        self.connect_timeout = connect_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self._cores = Cores(self.endpoints, connect_timeout=connect_timeout, heartbeat_timeout=heartbeat_timeout,
                            client_name=client_name, reconnect=reconnect)
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        self.model_info: ModelInfo | None = None
        self._bridges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _sink(self) -> _LoopSink:
        return _LoopSink(_bridge_for(asyncio.get_running_loop(), self._bridges))

    async def connect(self) -> "AsyncClient":
        """Wait for the handshake (and load the tokenizer unless it was passed as an object)."""
        if self.model_info is None:
            loop = asyncio.get_running_loop()
            welcome = await loop.run_in_executor(None, self._cores.wait_ready, self.connect_timeout + 1.0)
            self.model_info = welcome.model_info
        return self

    async def get_tokenizer(self):
        await self.connect()
        if self._tokenizer is None or isinstance(self._tokenizer, str):
            await asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)
        return self._tokenizer

    def _load_tokenizer(self) -> None:
        # On an executor thread; coroutines asking at once (from any loop) wait for one load.
        with self._tokenizer_lock:
            if self._tokenizer is None or isinstance(self._tokenizer, str):
                self._tokenizer = load_tokenizer(self._tokenizer or self.model_info.tokenizer or self.model_info.model)

    @property
    def max_request_tokens(self) -> int:
        """Prompt + max_tokens every core can hold for one request (0 before the handshake)."""
        return self._cores.max_request_tokens

    @property
    def gone_for_good(self) -> LLMServeError | None:
        """Why this client will never serve again (closed, another model came back on every endpoint, ...),
        else None."""
        return self._cores.final

    @property
    def cores_gone_for_good(self) -> list[tuple[str, LLMServeError]]:
        """(endpoint, why) of each core that will never serve this client again."""
        return [(ep, t.final) for ep, t in zip(self.endpoints, self._cores.transports) if t.final is not None]

    async def stream(self, prompt, *, request_id: str | None = None, detokenize: bool = True,
                     skip_special_tokens: bool = True, user: str = "", **sampling) -> "AsyncStream":
        """Start a request; `async for chunk in await client.stream(...)`. Cancelling the consuming task, or
        aclose(), aborts the request in the engine. `user`: as in Client.stream."""
        await self.connect()
        params = build_params(sampling, detokenize)
        tok = await self.get_tokenizer() if (detokenize or not _is_ids(prompt)) else None
        ids = to_token_ids(prompt, lambda: tok)
        return AsyncStream(self._cores, self._sink(), request_id or new_request_id(), ids, params, tok,
                           detokenize, skip_special_tokens, user)

    async def generate(self, prompt, *, request_id: str | None = None, detokenize: bool = True,
                       skip_special_tokens: bool = True, user: str = "", **sampling) -> Completion:
        s = await self.stream(prompt, request_id=request_id, detokenize=detokenize,
                              skip_special_tokens=skip_special_tokens, user=user, **sampling)
        async with s:
            async for _ in s:
                pass
        return s.completion

    async def embed(self, texts, *, instruction: str | None = None, dimensions: int | None = None,
                    normalize: bool = True, user: str = "") -> Embeddings:
        """As Client.embed."""
        inputs, are_ids = pooling.embedding_inputs(texts)
        params = pooling.embed_params(dimensions, normalize)
        tok = None if are_ids else await self.get_tokenizer()
        prompts = inputs if are_ids else [pooling.embedding_prompt(tok, t, instruction) for t in inputs]
        return pooling.embeddings_of(await self.pool(prompts, params, user=user))

    async def score(self, query: str, documents: list[str], *, instruction: str | None = None,
                    user: str = "") -> Scores:
        """As Client.score."""
        docs = pooling.check_texts("documents", documents)
        tok = await self.get_tokenizer()
        prompts = pooling.rerank_prompts(tok, query, docs, instruction)
        return pooling.scores_of(await self.pool(prompts, pooling.score_params(pooling.yes_no_ids(tok)), user=user))

    async def pool(self, prompts: list[list[int]], params: PoolingParams, *, request_id: str | None = None,
                   user: str = "") -> list[PoolingOutput]:
        """As Client.pool. Cancelling the caller aborts the requests still running."""
        await self.connect()
        pooling.check_task(self.model_info, params.task)
        prompts = [check_token_ids(list(p)) for p in prompts]
        sink = self._sink()
        batch = pooling.PoolBatch(self._cores, prompts, params, sink, request_id or new_request_id(), user)
        try:
            while not batch.done:
                batch.handle(await sink.queue.get())
        finally:
            batch.close()
        return batch.outputs

    async def abort(self, request_id: str) -> None:
        req = self._cores.find(request_id)
        if req is not None:
            req.abort()

    async def stats(self, timeout: float | None = None) -> dict:
        """As Client.stats: one core's counters, or over several cores their sums and per-core entries."""
        await self.connect()
        timeout = timeout or self.heartbeat_timeout + 5.0
        if self._cores.single:
            return await self._core_stats(self._cores.transports[0], timeout)
        if self._cores.dead is not None:
            raise self._cores.dead
        replies = await asyncio.gather(*(self._core_stats(t, timeout) for t in self._cores.transports),
                                       return_exceptions=True)
        for r in replies:
            if isinstance(r, BaseException) and not isinstance(r, (LLMServeError, asyncio.TimeoutError)):
                raise r
        return aggregate_stats(self.endpoints, replies, self._cores.in_flight(), list(self._cores.routed))

    async def _core_stats(self, transport: Transport, timeout: float) -> dict:
        sink = self._sink()
        nonce = transport.request_stats(sink)
        try:
            kind, value = await asyncio.wait_for(sink.queue.get(), timeout)
        finally:
            transport.drop_stats_waiter(nonce)
        if kind == "dead":
            raise value
        return value

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._cores.close)

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncStream(RequestStream):
    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self

    async def __anext__(self) -> StreamChunk:
        while not self._done:
            try:
                kind, *rest = await self._sink.queue.get()
            except asyncio.CancelledError:
                self._abort()
                raise
            chunk = self._handle(kind, rest)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._abort()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self._abort()


def _is_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)
