"""What the sync and async streams share: sending one request, turning its messages into StreamChunks, and
ending it (released, or aborted in the engine when closed early or cut by a stop string)."""
from __future__ import annotations

import time

from llmserve_client.cores import Cores, open_request
from llmserve_client.errors import RequestError
from llmserve_client.request_state import RequestState
from llmserve_client.types import Completion, StreamChunk


class RequestStream:
    """sink: where the transport delivers this request's messages (a queue, which the subclass reads)."""

    def __init__(self, cores: Cores, sink, request_id: str, ids: list[int], params, tokenizer,
                 detokenize: bool, skip_special_tokens: bool, user: str = ""):
        self.request_id = request_id
        self._state = RequestState(request_id, ids, params, tokenizer, detokenize=detokenize,
                                   skip_special_tokens=skip_special_tokens)
        self._sink = sink
        self._done = True      # until it is sent: a failed start leaves nothing to abort
        self._state.timings.sent = time.monotonic()
        self._request = open_request(cores, request_id, ids, params, sink, user)
        self._transport = self._request.transport
        self._done = False

    @property
    def completion(self) -> Completion:
        return self._state.completion()

    @property
    def endpoint(self) -> str:
        """The core serving this request (of the client's endpoints)."""
        return self._transport.endpoint

    def _handle(self, kind, rest) -> StreamChunk | None:
        """One message from the sink: the chunk it makes (None where it makes none yet); an error or the
        core's death ends the stream and raises."""
        if kind == "output":
            out, _batch_time, recv_time = rest
            chunk = self._state.on_output(out, recv_time)
            if self._state.finished:
                self._end(abort=self._state.needs_abort)
            return chunk
        self._end(abort=False)
        if kind == "error":
            err = rest[0]
            raise RequestError(err.field, err.message, self.request_id)
        raise rest[0]   # "dead"

    def _end(self, abort: bool) -> None:
        self._done = True
        self._request.release(abort)

    def _abort(self) -> None:
        if not self._done:
            self._end(abort=True)

    def __del__(self):
        if not getattr(self, "_done", True):
            self._abort()
