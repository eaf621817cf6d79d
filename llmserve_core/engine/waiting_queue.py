"""The scheduler's waiting queue: round-robin across clients, first come first served within one.

Admitting strictly by arrival lets one client's flood of requests delay everyone else's by the whole
flood. Here every client (the `client` key of its requests; None for the in-process engine) has its own
FIFO, and admission takes the head of one client's FIFO, then moves that client behind the others. A
head that cannot be admitted yet (no KV blocks) stays the head, so large requests are not starved; one
that may not start yet (its grammar compiling) is passed over in that order.
Preempted requests were already running: they go before every client's queue, most recent first, so the
oldest work keeps progressing (the scheduler's no-deadlock argument).
"""
from __future__ import annotations

from collections import OrderedDict

from llmserve_core.engine.request import Request


class WaitingQueue:
    def __init__(self):
        self._preempted: OrderedDict[str, Request] = OrderedDict()
        self._clients: OrderedDict[object, OrderedDict[str, Request]] = OrderedDict()
        self._len = 0
        # Prompt tokens of the new requests waiting, all together and per client (the queue caps' other
        # measure: a waiting prompt is held as a Python list, about 44 bytes a token).
        self._tokens = 0
        self._client_tokens: dict[object, int] = {}

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self):
        """Every waiting request: the preempted first, then each client's in arrival order."""
        yield from self._preempted.values()
        for fifo in self._clients.values():
            yield from fifo.values()

    def append(self, req: Request) -> None:
        """A new request: to the back of its client's queue."""
        self._clients.setdefault(req.client, OrderedDict())[req.request_id] = req
        self._len += 1
        self._count_tokens(req, 1)

    def push_preempted(self, req: Request) -> None:
        """A preempted request: ahead of everything waiting."""
        self._preempted[req.request_id] = req
        self._preempted.move_to_end(req.request_id, last=False)
        self._len += 1

    def peek(self, skip: frozenset[str] | set[str] = frozenset()) -> Request | None:
        """The request admission would take next, passing over the ids in `skip` (requests that may not
        start yet); None when every waiting request is skipped."""
        return next(self.admission_order(skip), None)

    def pop(self, req: Request | None = None) -> Request:
        """Take the request peek() returned (default: the head); its client's turn passes to the next client."""
        if req is None:
            req = self.peek()
        if self._preempted.pop(req.request_id, None) is not None:
            self._len -= 1
            return req
        fifo = self._clients[req.client]
        del fifo[req.request_id]
        if fifo:
            self._clients.move_to_end(req.client)
        else:
            del self._clients[req.client]
        self._len -= 1
        self._count_tokens(req, -1)
        return req

    def admission_order(self, skip: frozenset[str] | set[str] = frozenset()):
        """Lazily, passing over the ids in `skip`: the preempted, then each client's first request in turn,
        then each one's second, ... Valid until the queue changes (pop, append, remove)."""
        for req in self._preempted.values():
            if req.request_id not in skip:
                yield req
        turns = [iter(fifo.values()) for fifo in self._clients.values()]
        while turns:
            alive = []
            for it in turns:
                req = next(it, None)
                if req is not None:
                    if req.request_id not in skip:
                        yield req
                    alive.append(it)
            turns = alive

    def remove(self, req: Request) -> bool:
        """Drop a request (aborted while waiting); False if it is not here. O(1)."""
        if self._preempted.pop(req.request_id, None) is not None:
            self._len -= 1
            return True
        fifo = self._clients.get(req.client)
        if fifo is None or fifo.pop(req.request_id, None) is None:
            return False
        if not fifo:
            del self._clients[req.client]
        self._len -= 1
        self._count_tokens(req, -1)
        return True

    def count(self, client) -> int:
        """New (never admitted) requests of `client` waiting."""
        fifo = self._clients.get(client)
        return len(fifo) if fifo is not None else 0

    def num_tokens(self, client=None) -> int:
        """Prompt tokens of the new requests waiting: `client`'s, or with no client all of them."""
        return self._tokens if client is None else self._client_tokens.get(client, 0)

    def _count_tokens(self, req: Request, sign: int) -> None:
        n = sign * req.num_prompt_tokens
        self._tokens += n
        left = self._client_tokens.get(req.client, 0) + n
        if left:
            self._client_tokens[req.client] = left
        else:
            self._client_tokens.pop(req.client, None)
