"""Client: the synchronous client library. Thread-safe: many threads may generate at once."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from llmserve_proto import Abort, Generate, ModelInfo, default_endpoint
from llmserve_client.errors import EngineDeadError, RequestError
from llmserve_client.inputs import build_params, load_tokenizer, new_request_id, to_token_ids
from llmserve_client.request_state import RequestState
from llmserve_client.transport import Transport
from llmserve_client.types import Completion, StreamChunk


class Client:
    """Talks to one llmserve-core.

    endpoint: ipc://PATH or tcp://HOST:PORT (default: the core's default ipc socket).
    tokenizer: a tokenizer object or a path; default: the model directory the core announces.
    connect_timeout: how long to wait for a core that is not up yet (or still loading its model).
    heartbeat_timeout: a core silent this long is declared dead; every waiting call raises EngineDeadError.
    reconnect: after the core dies, keep saying hello on the endpoint and serve again once a core running
        the same model answers (calls raise EngineDeadError meanwhile); False: the client stays dead.
    """

    def __init__(self, endpoint: str | None = None, *, tokenizer=None, connect_timeout: float = 60.0,
                 heartbeat_timeout: float = 5.0, client_name: str = "", reconnect: bool = True):
        self.endpoint = endpoint or default_endpoint()
        self._transport = Transport(self.endpoint, connect_timeout=connect_timeout,
                                    heartbeat_timeout=heartbeat_timeout, client_name=client_name,
                                    reconnect=reconnect)
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        self.heartbeat_timeout = heartbeat_timeout
        try:
            welcome = self._transport.wait_ready(connect_timeout + 1.0)
        except BaseException:
            self._transport.close()
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
               skip_special_tokens: bool = True, **sampling) -> "Stream":
        """Start a request; iterate the result for StreamChunks. `sampling`: SamplingParams fields."""
        return Stream(self, prompt, request_id, detokenize, skip_special_tokens, sampling)

    def generate(self, prompt, *, request_id: str | None = None, detokenize: bool = True,
                 skip_special_tokens: bool = True, **sampling) -> Completion:
        """Run one request to the end. Raises RequestError if it is rejected, EngineDeadError if the core dies."""
        with self.stream(prompt, request_id=request_id, detokenize=detokenize,
                         skip_special_tokens=skip_special_tokens, **sampling) as s:
            for _ in s:
                pass
            return s.completion

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort". Unknown ids are ignored."""
        self._transport.send(Abort(request_ids=[request_id]))

    def stats(self, timeout: float | None = None) -> dict:
        """The engine's counters: running, waiting, free/total KV blocks, prefix hit rate, ..."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        nonce = self._transport.request_stats(q)
        try:
            kind, value = _get(q, timeout or self.heartbeat_timeout + 5.0, self._transport)
        finally:
            self._transport.drop_stats_waiter(nonce)
        if kind == "dead":
            raise value
        return value

    def close(self) -> None:
        """Abort this client's live requests in the core and close the connection."""
        self._transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream:
    """Iterator of StreamChunks for one request. `.completion` holds the whole result once it ends.
    Closing it early (close(), leaving a `with` block, or garbage collection) aborts the request."""

    def __init__(self, client: Client, prompt, request_id, detokenize, skip_special_tokens, sampling):
        params = build_params(sampling)
        if params.stop and not detokenize:
            raise RequestError("stop", "stop strings need detokenize=True")
        ids = to_token_ids(prompt, lambda: client.tokenizer)
        self.request_id = request_id or new_request_id()
        self._transport = client._transport
        self._timeout = client.heartbeat_timeout
        tok = client.tokenizer if detokenize else None
        self._state = RequestState(self.request_id, ids, params, tok, detokenize=detokenize,
                                   skip_special_tokens=skip_special_tokens)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = False
        try:
            self._transport.register(self.request_id, self._queue)
        except ValueError as e:
            raise RequestError("request_id", str(e).split(": ", 1)[-1], self.request_id) from None
        self._state.timings.sent = time.monotonic()
        try:
            self._transport.send(Generate(request_id=self.request_id, prompt_token_ids=ids, params=params))
        except BaseException:
            self._transport.unregister(self.request_id)
            self._done = True
            raise

    @property
    def completion(self) -> Completion:
        return self._state.completion()

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        while not self._done:
            kind, *rest = _get(self._queue, None, self._transport)
            chunk = self._handle(kind, rest)
            if chunk is not None:
                return chunk
        raise StopIteration

    def _handle(self, kind, rest) -> StreamChunk | None:
        if kind == "output":
            out, _batch_time, recv_time = rest
            chunk = self._state.on_output(out, recv_time)
            if self._state.finished:
                self._finish()
            return chunk
        self._done = True
        if kind == "error":
            err = rest[0]
            raise RequestError(err.field, err.message, err.request_id)
        raise rest[0]   # "dead"

    def _finish(self) -> None:
        self._done = True
        if self._state.needs_abort:
            self._abort_quietly()

    def _abort_quietly(self) -> None:
        try:
            self._transport.send(Abort(request_ids=[self.request_id]))
        except EngineDeadError:
            pass

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._abort_quietly()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_done", True):
            self.close()


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
