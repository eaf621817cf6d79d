"""Socket thread: the only owner of the core's ROUTER socket.

It receives, decodes and checks client frames and queues work for the busy loop; it sends the frames the
output thread encoded (arriving over an inproc PAIR); it keeps the client registry, sends heartbeats, and
reports clients that vanished: a send that fails with EHOSTUNREACH (ROUTER_MANDATORY: the peer's
connection is gone, which a killed process triggers at once), silence longer than client_timeout
(covers peers that vanish without closing the connection), or not reading what it is sent (outbox.py).
Bad input is answered to its sender and logged (escaped, truncated, rate-limited per client); it never
reaches the engine. Each poll reads a bounded number of frames; ZMQ fair-queues the peers, so one
client's flood takes its turn beside the others and never holds up heartbeats or outputs.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from llmserve_proto import (PROTOCOL_VERSION, Abort, BadMessage, EngineError, Generate, Goodbye, Heartbeat,
                            Hello, Pool, RequestError, StatsRequest, ValidationError, Welcome,
                            decode_client_checked, encode)
from llmserve_proto.codec import MAX_FRAME_BYTES
from llmserve_proto.endpoint import is_ipv6_endpoint
from llmserve_proto.messages import validate_client_message
from llmserve_core.server.events import AbortRequests, ClientGone, NewRequest, SocketFailed, StatsQuery
from llmserve_core.server.log_safety import LogLimiter, printable
from llmserve_core.server.outbox import SEND_HWM, Outbox
from llmserve_core.server.output_thread import BROADCAST

log = logging.getLogger("llmserve_core.server")

MAX_FRAMES_PER_POLL = 1000
RECV_HWM = 1000           # messages ZMQ buffers per client before it stops reading that client's connection


STATS_BURST = 32
STATS_PER_SECOND = 50.0


@dataclass
class ClientInfo:
    last_seen: float
    name: str
    stats_budget: float = 0.0        # stats queries this client may still send now (refilled over time)
    stats_refilled: float = 0.0


class SocketThread(threading.Thread):
    def __init__(self, ctx: zmq.Context, router: zmq.Socket, pair_addr: str, in_q: queue.SimpleQueue,
                 welcome: Welcome, heartbeat_interval: float, client_timeout: float,
                 max_unread_bytes: int = 16 * 1024 * 1024):
        super().__init__(name="llmserve-socket", daemon=True)
        self.router = router
        self.in_q = in_q
        self.welcome = welcome
        self.info = welcome.model_info
        self.heartbeat_interval = heartbeat_interval
        self.client_timeout = client_timeout
        self.clients: dict[bytes, ClientInfo] = {}
        self.accepting = True          # cleared by the daemon when draining: new requests are refused
        self.pair = ctx.socket(zmq.PAIR)
        self.pair.setsockopt(zmq.RCVHWM, 0)
        self.pair.bind(pair_addr)
        # Unread messages are held up to this per client, for at most client_timeout (see outbox.py).
        self.outbox = Outbox(max_unread_bytes, client_timeout)
        self.warnings = LogLimiter()

    # ---- helpers ------------------------------------------------------------------------------------
    def _try_send(self, client: bytes, payload) -> bool:
        """False when the client's pipe is full (keep the frame); True when sent, or when the peer is gone
        (then it is dropped: nothing is kept for it)."""
        try:
            self.router.send_multipart([client, payload], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EAGAIN:
                return False
            if e.errno == errno.EHOSTUNREACH:
                self._drop(client, "connection lost")
                return True
            raise

    def _send(self, client: bytes, payload) -> None:
        if client not in self.clients:
            # No session (a stranger, or a client already dropped): one attempt, nothing queued for it.
            try:
                self.router.send_multipart([client, payload], flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:
                if e.errno not in (zmq.EAGAIN, errno.EHOSTUNREACH):
                    raise
            return
        reason = self.outbox.send(client, payload, self._try_send, time.monotonic())
        if reason is not None:
            self._drop(client, reason)

    def _stats_allowed(self, client: bytes, now: float) -> bool:
        """At most STATS_BURST stats queries at once and STATS_PER_SECOND after that, per client: each
        costs the busy loop a stats() and the client a reply, so a flood of them (read or not) must not
        grow the core's queues. Queries past the rate get no reply (PROTOCOL.md)."""
        info = self.clients.get(client)
        if info is None:
            return True
        info.stats_budget = min(STATS_BURST, info.stats_budget + (now - info.stats_refilled) * STATS_PER_SECOND)
        info.stats_refilled = now
        if info.stats_budget < 1.0:
            return False
        info.stats_budget -= 1.0
        return True

    def _reply(self, client: bytes, msg) -> None:
        self._send(client, encode(msg))

    def _drop(self, client: bytes, reason: str) -> None:
        info = self.clients.pop(client, None)
        self.outbox.forget(client)
        if info is not None:
            log.info("client %s (%s) gone: %s", client.hex(), info.name or "-", reason)
            self.in_q.put(ClientGone(client, reason))

    def _warn(self, client: bytes, fmt: str, *args) -> None:
        """A warning about one client's input: at most a few lines per client per window."""
        allowed, suppressed = self.warnings.allow(client)
        if suppressed:
            log.warning("client %s: %d similar warning(s) suppressed", client.hex(), suppressed)
        if allowed:
            log.warning(fmt, *args)

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pair, zmq.POLLIN)
        next_beat = last_turn = time.monotonic()
        try:
            while True:
                events = dict(poller.poll(timeout=max(1, int(self.heartbeat_interval * 250))))
                if self.pair in events and self._forward_outputs():
                    return
                if self.router in events:
                    self._receive()
                now = time.monotonic()
                self._excuse(now - last_turn - self.heartbeat_interval, now)
                last_turn = now
                for client, reason in self.outbox.flush(self._try_send, now):
                    self._drop(client, reason)
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval
                    heartbeat = encode(Heartbeat(time=now))
                    for client in list(self.clients):
                        self._send(client, heartbeat)
                    for client, info in list(self.clients.items()):
                        if now - info.last_seen > self.client_timeout:
                            self._drop(client, f"silent for {now - info.last_seen:.1f} s")
        except Exception:
            log.exception("socket thread failed")
            self.in_q.put(SocketFailed("socket thread failed; see the traceback above"))
        finally:
            self.pair.close(linger=0)

    def _excuse(self, away: float, now: float) -> None:
        """`away`: how much later than a heartbeat interval this turn came (the poll waits a quarter of one).
        For that long the thread was kept from its socket (the process stopped, the machine or the GIL
        starved it): its clients' messages sat unread and their outputs unsent, so it counts neither as
        their silence nor as their not reading. Else a core stalled past client_timeout would drop every
        client on waking, aborting the requests of clients that pinged throughout."""
        if away <= 0:
            return
        for info in self.clients.values():
            info.last_seen = min(now, info.last_seen + away)
        self.outbox.excuse(away, now)

    def _forward_outputs(self) -> bool:
        """Send what the output thread encoded; True once it says the core is done."""
        while True:
            try:
                client, payload = self.pair.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            client = client.bytes
            if client == BROADCAST:
                if len(payload) == 0:
                    return True
                for c in list(self.clients):
                    self._send(c, payload)
            elif client in self.clients:
                self._send(client, payload)

    def _receive(self) -> None:
        for _ in range(MAX_FRAMES_PER_POLL):   # bounded, so a flood cannot starve heartbeats and outputs
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            client = frames[0].bytes
            if len(frames) != 2:
                self._bad(client, f"expected one frame per message, got {len(frames) - 1}")
                continue
            try:
                msg = decode_client_checked(frames[1].buffer)
            except BadMessage as e:
                self._bad(client, e.message, e.request_id, e.field)
                continue
            self._handle(client, msg, time.monotonic())

    def _bad(self, client: bytes, message: str, request_id: str | None = None, field: str = "") -> None:
        self._warn(client, "bad message from client %s: %s", client.hex(), printable(message, 300))
        info = self.clients.get(client)
        if info is not None:
            info.last_seen = time.monotonic()
        if request_id is not None and info is not None:
            self._reply(client, RequestError(request_id=request_id, field=field, message=message))
        else:
            self._reply(client, EngineError(message=f"{field}: {message}" if field else message))

    def _handle(self, client: bytes, msg, now: float) -> None:
        if isinstance(msg, Hello):
            if msg.protocol_version != PROTOCOL_VERSION:
                self._warn(client, "client %s speaks protocol %s, not %d", client.hex(),
                           printable(msg.protocol_version), PROTOCOL_VERSION)
                self._reply(client, EngineError(message=f"protocol version {printable(msg.protocol_version)} not "
                                                        f"supported; this core speaks {PROTOCOL_VERSION}", fatal=True))
                return
            if not self.accepting:
                self._reply(client, EngineError(message="the core is shutting down", fatal=True))
                return
            name = printable(msg.client_name, 100)
            info = self.clients.get(client)
            if info is None:
                self.clients[client] = ClientInfo(now, name)
                log.info("client %s (%s) connected", client.hex(), name or "-")
            else:   # the same session: a fresh ClientInfo would refill its stats rate on every hello
                info.last_seen, info.name = now, name
            self._reply(client, self.welcome)
            return
        info = self.clients.get(client)
        if info is None:
            self._reply(client, EngineError(message="unknown client: send hello first (or it timed out)", fatal=True))
            return
        info.last_seen = now
        error = self._check(msg)
        if error is not None:
            field, message = error
            if isinstance(msg, (Generate, Pool)):
                self._warn(client, "rejected request %s of client %s: %s: %s", printable(msg.request_id),
                           client.hex(), printable(field), printable(message, 300))
                self._reply(client, RequestError(request_id=msg.request_id, field=field, message=message))
            else:
                self._bad(client, f"{field}: {message}")
            return
        if isinstance(msg, (Generate, Pool)):
            self.in_q.put(NewRequest(client, msg, now))
        elif isinstance(msg, Abort):
            self.in_q.put(AbortRequests(client, list(msg.request_ids)))
        elif isinstance(msg, StatsRequest):
            if self._stats_allowed(client, now):
                self.in_q.put(StatsQuery(client, msg.nonce))
        elif isinstance(msg, Goodbye):
            self._drop(client, "said goodbye")

    def _check(self, msg) -> tuple[str, str] | None:
        """Every field within its bounds (proto/bounds.py) and the model's limits, checked here so bad input
        never reaches the busy loop (the engine checks requests again)."""
        try:
            validate_client_message(msg)
        except ValidationError as e:
            return e.field, e.message
        if not isinstance(msg, (Generate, Pool)):
            return None
        if not self.accepting:
            return "", "the core is shutting down and accepts no new requests"
        ids, info = msg.prompt_token_ids, self.info
        if max(ids) >= info.vocab_size:
            return "prompt_token_ids", f"token ids must be in [0, {info.vocab_size})"
        if isinstance(msg, Pool):       # the engine checks the rest (dimensions, token ids, the pool)
            if msg.params.task not in info.tasks:
                return "task", f"{msg.params.task!r} requests are not served by this core (it serves {info.tasks})"
            if len(ids) > info.max_model_len:
                return "prompt_token_ids", f"prompt of {len(ids)} tokens exceeds max_model_len {info.max_model_len}"
            return None
        if "generate" not in info.tasks:
            return "task", "this core runs the pooling runner: it serves embed and score requests, not generation"
        if len(ids) + msg.params.max_tokens > info.max_model_len:
            return "max_tokens", (f"prompt ({len(ids)}) + max_tokens ({msg.params.max_tokens}) exceeds "
                                  f"max_model_len {info.max_model_len}")
        if any(t >= info.vocab_size for t in msg.params.stop_token_ids):
            return "stop_token_ids", f"token ids must be in [0, {info.vocab_size})"
        return None


def bind_router(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """ROUTER socket bound at endpoint; an ipc socket file is created 0600."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, SEND_HWM)    # past it sends fail (ROUTER_MANDATORY) into the outbox
    router.setsockopt(zmq.RCVHWM, RECV_HWM)
    router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    router.setsockopt(zmq.LINGER, 500)
    if is_ipv6_endpoint(endpoint):
        router.setsockopt(zmq.IPV6, 1)
    old = os.umask(0o177)
    try:
        router.bind(endpoint)
    except zmq.ZMQError:
        router.close(linger=0)      # else the context could never terminate
        raise
    finally:
        os.umask(old)
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://"):], 0o600)
    return router
