"""Client: the synchronous client library. Thread-safe: many threads may generate at once."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from llmserve_proto import ModelInfo, PoolingOutput, PoolingParams
from llmserve_client import pooling
from llmserve_client.cores import Cores, aggregate_stats, endpoint_list
from llmserve_client.errors import LLMServeError
from llmserve_client.inputs import build_params, check_token_ids, load_tokenizer, new_request_id, to_token_ids
from llmserve_client.request_stream import RequestStream
from llmserve_client.transport import Transport
from llmserve_client.types import Completion, Embeddings, Scores, StreamChunk


class Client:
    """Talks to one llmserve-core, or to several serving the same model (data parallelism).

    endpoint: ipc://PATH or tcp://HOST:PORT (default: the core's default ipc socket), or a list of them:
        each request then goes to the least loaded core, preferring the one that already holds its prompt's
        first KV block (see router.py); a dead core is left out until it is back.
    tokenizer: a tokenizer object or a path; default: the model directory the core announces.
    connect_timeout: how long to wait for a core that is not up yet (or still loading its model); with
        several endpoints, every core must answer within it.
    heartbeat_timeout: a core silent this long is declared dead; every call waiting on it raises EngineDeadError.
    reconnect: after a core dies, keep saying hello on its endpoint and serve again once a core running
        the same model answers (meanwhile calls raise EngineDeadError when no other core is up); False: a
        dead core stays dead.
    """

    def __init__(self, endpoint: str | list[str] | None = None, *, tokenizer=None, connect_timeout: float = 60.0,
                 heartbeat_timeout: float = 5.0, client_name: str = "", reconnect: bool = True):
        self.endpoints = endpoint_list(endpoint)
        self.endpoint = self.endpoints[0]
        self._cores = Cores(self.endpoints, connect_timeout=connect_timeout, heartbeat_timeout=heartbeat_timeout,
                            client_name=client_name, reconnect=reconnect)
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        self.heartbeat_timeout = heartbeat_timeout
        try:
            welcome = self._cores.wait_ready(connect_timeout + 1.0)
        except BaseException:
            self._cores.close()
            raise
        self.model_info: ModelInfo = welcome.model_info

    @property
    def tokenizer(self):
        """The tokenizer, loaded on first use (a token-ids-only client never loads one). Threads that ask at
        once wait for one load."""
        tok = self._tokenizer
        if tok is None or isinstance(tok, str):
            with self._tokenizer_lock:
                if self._tokenizer is None or isinstance(self._tokenizer, str):
                    path = self._tokenizer or self.model_info.tokenizer or self.model_info.model
                    self._tokenizer = load_tokenizer(path)
                tok = self._tokenizer
        return tok

    def stream(self, prompt, *, request_id: str | None = None, detokenize: bool = True,
               skip_special_tokens: bool = True, user: str = "", **sampling) -> "Stream":
        """Start a request; iterate the result for StreamChunks. `sampling`: SamplingParams fields. `user`:
        whom the request is for, when this client serves several (the core shares fairly between them)."""
        return Stream(self, prompt, request_id, detokenize, skip_special_tokens, sampling, user)

    def generate(self, prompt, *, request_id: str | None = None, detokenize: bool = True,
                 skip_special_tokens: bool = True, user: str = "", **sampling) -> Completion:
        """Run one request to the end. Raises RequestError if it is rejected, EngineDeadError if the core dies."""
        with self.stream(prompt, request_id=request_id, detokenize=detokenize,
                         skip_special_tokens=skip_special_tokens, user=user, **sampling) as s:
            for _ in s:
                pass
            return s.completion

    def embed(self, texts, *, instruction: str | None = None, dimensions: int | None = None,
              normalize: bool = True, user: str = "") -> Embeddings:
        """Embeddings of a text or a list of texts (or token-id lists, sent as they are), in order. Qwen3-
        Embedding's prompts: with an `instruction` each text is a query (`Instruct: ...\nQuery:...`); every
        text ends with `<|endoftext|>`. dimensions: keep the first n values; normalize: L2, after that."""
        inputs, are_ids = pooling.embedding_inputs(texts)
        params = pooling.embed_params(dimensions, normalize)
        prompts = inputs if are_ids else [pooling.embedding_prompt(self.tokenizer, t, instruction) for t in inputs]
        return pooling.embeddings_of(self.pool(prompts, params, user=user))

    def score(self, query: str, documents: list[str], *, instruction: str | None = None, user: str = "") -> Scores:
        """A reranker's relevance of each document to the query (Qwen3-Reranker's prompt; the default
        instruction is the model card's): p(yes) and the log-odds logit("yes") - logit("no"), in order."""
        docs = pooling.check_texts("documents", documents)
        tok = self.tokenizer
        prompts = pooling.rerank_prompts(tok, query, docs, instruction)
        return pooling.scores_of(self.pool(prompts, pooling.score_params(pooling.yes_no_ids(tok)), user=user))

    def pool(self, prompts: list[list[int]], params: PoolingParams, *, request_id: str | None = None,
             user: str = "") -> list[PoolingOutput]:
        """One pooling request per token-id prompt, run to the end: their PoolingOutputs, in order. Raises
        RequestError (with `index`, the failed prompt's) if one is rejected; the others are aborted."""
        pooling.check_task(self.model_info, params.task)
        prompts = [check_token_ids(list(p)) for p in prompts]
        q: queue.SimpleQueue = queue.SimpleQueue()
        batch = pooling.PoolBatch(self._cores, prompts, params, q, request_id or new_request_id(), user)
        try:
            while not batch.done:
                batch.handle(_get(q, None, batch.requests[0].transport))
        finally:
            batch.close()
        return batch.outputs

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort". Unknown ids are ignored, as are those
        of requests whose end the caller has already seen."""
        req = self._cores.find(request_id)
        if req is not None:
            req.abort()

    def stats(self, timeout: float | None = None) -> dict:
        """The engine's counters: running, waiting, free/total KV blocks, prefix hit rate, ... Over several
        cores: the sums (rates recomputed), and per core under "cores" (see cores.aggregate_stats)."""
        timeout = timeout or self.heartbeat_timeout + 5.0
        if self._cores.single:
            return _core_stats(self._cores.transports[0], timeout)
        if self._cores.dead is not None:
            raise self._cores.dead
        replies = []
        for t in self._cores.transports:     # one after another: a dead core answers at once, a live one fast
            try:
                replies.append(_core_stats(t, timeout))
            except (LLMServeError, TimeoutError) as e:
                replies.append(e)
        return aggregate_stats(self.endpoints, replies, self._cores.in_flight(), list(self._cores.routed))

    def close(self) -> None:
        """Abort this client's live requests in the cores and close the connections."""
        self._cores.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream(RequestStream):
    """Iterator of StreamChunks for one request. `.completion` holds the whole result once it ends.
    Closing it early (close(), leaving a `with` block, or garbage collection) aborts the request."""

    def __init__(self, client: Client, prompt, request_id, detokenize, skip_special_tokens, sampling, user=""):
        params = build_params(sampling, detokenize)
        ids = to_token_ids(prompt, lambda: client.tokenizer)
        super().__init__(client._cores, queue.SimpleQueue(), request_id or new_request_id(), ids, params,
                         client.tokenizer if detokenize else None, detokenize, skip_special_tokens, user)

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        while not self._done:
            kind, *rest = _get(self._sink, None, self._transport)
            chunk = self._handle(kind, rest)
            if chunk is not None:
                return chunk
        raise StopIteration

    def close(self) -> None:
        self._abort()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _core_stats(transport: Transport, timeout: float) -> dict:
    q: queue.SimpleQueue = queue.SimpleQueue()
    nonce = transport.request_stats(q)
    try:
        kind, value = _get(q, timeout, transport)
    finally:
        transport.drop_stats_waiter(nonce)
    if kind == "dead":
        raise value
    return value


def _get(q: queue.SimpleQueue, timeout: float | None, transport: Transport):
    """Wait on a sink queue. The transport always delivers death into every sink, but poll it as well so a
    bug there can never leave a caller blocked forever."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            if transport.dead is not None:
                return ("dead", transport.dead)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no reply from the core in time") from None
