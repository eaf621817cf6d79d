"""The scheduler's waiting queue, and how many running slots each client holds: fair turns across clients.

A client is the `client` key its requests carry: the daemon's is (connection, user), so one connection that
serves many users (the HTTP frontend) shares fairly between them as well; None for the in-process engine
unless its caller says otherwise. Each client has its own FIFO. Admission takes the head of the client that
holds the fewest running requests (ties: the one whose turn came longest ago), so running slots converge on
a max-min fair split: a client that wants less than an equal share gets all it wants, the others share the
rest equally, and a lone client gets every slot. A head that cannot be admitted yet (no KV blocks) stays
the head, so large requests are not starved; one that may not start yet (its grammar compiling) is passed
over in that order.
A preempted request goes back to the front of its own client's FIFO: it runs again before that client's
newer requests, but takes no turn from other clients.
A client with nothing waiting and nothing running is forgotten, so what is kept here is bounded by the
requests held, however many client names a peer invents.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from llmserve_core.engine.request import Request


@dataclass
class _Client:
    fifo: OrderedDict[str, Request] = field(default_factory=OrderedDict)
    running: int = 0
    new: int = 0            # requests never admitted yet (the queue caps' measure; the preempted ran before)
    tokens: int = 0         # their prompt tokens


class WaitingQueue:
    def __init__(self):
        self._clients: dict[object, _Client] = {}
        # Clients with requests waiting, by how many they run: each bucket in turn order (a client moves to
        # the end of its new bucket when the count changes, so its turn passes).
        self._turns: dict[int, OrderedDict[object, None]] = {}
        self._preempted: set[str] = set()      # ids of the waiting requests that ran before
        self._len = 0
        # Prompt tokens of the new requests waiting, all together (the queue caps' other measure: a waiting
        # prompt is held as a Python list, about 44 bytes a token).
        self._tokens = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self):
        """Every waiting request, client by client, each client's in its order."""
        for c in self._clients.values():
            yield from c.fifo.values()

    # ---- arrivals and departures -------------------------------------------------------------------
    def append(self, req: Request) -> None:
        """A new request: to the back of its client's queue."""
        c = self._waiting_client(req.client)
        c.fifo[req.request_id] = req
        c.new += 1
        c.tokens += req.num_prompt_tokens
        self._tokens += req.num_prompt_tokens
        self._len += 1

    def push_preempted(self, req: Request) -> None:
        """A running request preempted: it gives its slot back and goes to the front of its client's queue."""
        self._set_running(req.client, -1)
        c = self._waiting_client(req.client)
        c.fifo[req.request_id] = req
        c.fifo.move_to_end(req.request_id, last=False)
        self._preempted.add(req.request_id)
        self._len += 1

    def pop(self, req: Request | None = None) -> Request:
        """Admit `req` (default: the head of the admission order): it leaves the queue and holds a running
        slot of its client's until stopped() or push_preempted()."""
        if req is None:
            req = self.peek()
        self._take(req)
        self._set_running(req.client, +1)
        return req

    def remove(self, req: Request) -> bool:
        """Drop a waiting request (aborted, or finished while preempted); False if it is not here. O(1)."""
        c = self._clients.get(req.client)
        if c is None or req.request_id not in c.fifo:
            return False
        self._take(req)
        return True

    def stopped(self, req: Request) -> None:
        """A running request finished: its slot is free."""
        self._set_running(req.client, -1)

    # ---- admission ---------------------------------------------------------------------------------
    def peek(self, skip: frozenset[str] | set[str] = frozenset()) -> Request | None:
        """The request admission would take next, passing over the ids in `skip` (requests that may not
        start yet); None when every waiting request is skipped."""
        return next(self.admission_order(skip), None)

    def admission_order(self, skip: frozenset[str] | set[str] = frozenset()):
        """Lazily, passing over the ids in `skip`: each client's first request, clients by fewest running
        then turn, then each one's second, ... Valid until the queue changes (pop, append, remove)."""
        turns = []
        for rank in sorted(self._turns):
            for key in self._turns[rank]:
                it = iter(self._clients[key].fifo.values())
                req = next(it)
                if req.request_id not in skip:
                    yield req
                turns.append(it)
        while turns:
            alive = []
            for it in turns:
                req = next(it, None)
                if req is not None:
                    if req.request_id not in skip:
                        yield req
                    alive.append(it)
            turns = alive

    def clients_in_turn(self):
        """Clients with requests waiting, in admission order (lazily; valid until the queue changes)."""
        for rank in sorted(self._turns):
            yield from self._turns[rank]

    # ---- counts ------------------------------------------------------------------------------------
    def running(self, client) -> int:
        """Running requests of `client`."""
        c = self._clients.get(client)
        return c.running if c is not None else 0

    def most_running(self) -> tuple[object, int]:
        """(client, its running requests) of the client that runs the most; (None, 0) when none runs."""
        best, most = None, 0
        for key, c in self._clients.items():
            if c.running > most:
                best, most = key, c.running
        return best, most

    def head(self, client) -> Request | None:
        c = self._clients.get(client)
        return next(iter(c.fifo.values()), None) if c is not None else None

    def count(self, client) -> int:
        """New (never admitted) requests of `client` waiting."""
        c = self._clients.get(client)
        return c.new if c is not None else 0

    def num_tokens(self, client=None) -> int:
        """Prompt tokens of the new requests waiting: `client`'s, or with no client all of them."""
        if client is None:
            return self._tokens
        c = self._clients.get(client)
        return c.tokens if c is not None else 0

    @property
    def num_clients(self) -> int:
        """Clients with anything waiting or running (what is kept per client here)."""
        return len(self._clients)

    # ---- bookkeeping -------------------------------------------------------------------------------
    def _waiting_client(self, key) -> _Client:
        c = self._clients.get(key)
        if c is None:
            c = self._clients[key] = _Client()
        if not c.fifo:
            self._turns.setdefault(c.running, OrderedDict())[key] = None
        return c

    def _take(self, req: Request) -> None:
        key = req.client
        c = self._clients[key]
        del c.fifo[req.request_id]
        self._len -= 1
        if req.request_id in self._preempted:
            self._preempted.discard(req.request_id)
        else:
            c.new -= 1
            c.tokens -= req.num_prompt_tokens
            self._tokens -= req.num_prompt_tokens
        if not c.fifo:
            self._leave_turns(key, c.running)
            if not c.running:
                del self._clients[key]

    def _set_running(self, key, delta: int) -> None:
        c = self._clients.get(key)
        if c is None:
            c = self._clients[key] = _Client()
        assert c.running + delta >= 0, (key, c.running, delta)
        if c.fifo:
            self._leave_turns(key, c.running)
            self._turns.setdefault(c.running + delta, OrderedDict())[key] = None
        c.running += delta
        if not c.running and not c.fifo:
            del self._clients[key]

    def _leave_turns(self, key, rank: int) -> None:
        bucket = self._turns[rank]
        del bucket[key]
        if not bucket:
            del self._turns[rank]
