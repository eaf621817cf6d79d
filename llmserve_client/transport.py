"""One DEALER socket to the core, owned by one background thread.

ZMQ sockets are not thread-safe, so callers never touch the socket: they encode on their own thread, queue
the frame and wake the transport thread through a pipe. The thread receives, decodes and routes each core
message to the sink registered for its request id (a queue of the sync client, or a bridge into an asyncio
loop), pings the core, and declares the core dead when (a) the connection drops (socket monitor), (b) the
core is silent longer than heartbeat_timeout, (c) the core says it is shutting down or has failed. Death is
delivered to every sink, so no waiting call can hang.

With reconnect on, a dead session is not the end: the thread opens a fresh socket (a new session, see
PROTOCOL.md §6) and says hello again until a core answers. Until then every call fails at once with the
EngineDeadError that ended the session. The core that answers must serve the same model as the first one
(ModelChangedError otherwise, which ends the transport for good).
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
import uuid

import zmq
from zmq.utils.monitor import parse_monitor_message

from llmserve_proto import (PROTOCOL_VERSION, EngineError, Goodbye, Heartbeat, Hello, ModelInfo, OutputBatch, Ping,
                            PooledBatch, RequestError, Shutdown, StatsReply, StatsRequest, Welcome, decode_core,
                            encode)
from llmserve_client.errors import (EngineDeadError, HandshakeTimeoutError, LLMServeError, ModelChangedError,
                                    ProtocolError)

log = logging.getLogger("llmserve_client")

# Items put into sinks: ("output", RequestOutput, batch_time, recv_time) | ("pooled", PoolingOutput,
# batch_time, recv_time) (a pooling request's one answer) | ("error", RequestError) | ("dead", exception).

# What a client relies on about the model: a restarted core must announce the same values.
MODEL_IDENTITY = ("model", "tokenizer", "vocab_size", "max_model_len", "eos_token_ids")
RECONNECT_BACKOFF_S = (0.05, 2.0)   # first and longest pause between two attempts to open a session
DRAIN_SLICE_S = 0.05   # the longest the transport thread reads the core's messages before it sends its own


def model_difference(old: ModelInfo, new: ModelInfo) -> str | None:
    """The first identity field that differs between two announcements, as "field: old -> new"."""
    for name in MODEL_IDENTITY:
        a, b = getattr(old, name), getattr(new, name)
        if a != b:
            return f"{name}: {a!r} -> {b!r}"
    return None


class Transport:
    def __init__(self, endpoint: str, *, connect_timeout: float = 60.0, heartbeat_timeout: float = 5.0,
                 client_name: str = "", reconnect: bool = True):
        # Written so that NaN fails too: a NaN heartbeat timeout would never declare a stopped core dead.
        if not connect_timeout >= 0:
            raise ValueError(f"connect_timeout: must be a number of seconds >= 0, got {connect_timeout!r}")
        if not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout: must be a number of seconds > 0, got {heartbeat_timeout!r}")
        self.endpoint = endpoint
        self.connect_timeout = connect_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.client_name = client_name
        self.reconnect = reconnect
        self.welcome: Welcome | None = None       # of the current (or last) session
        self.model_info: ModelInfo | None = None  # as the first core announced it; later ones must match
        self.dead: LLMServeError | None = None    # why calls fail now (None: a session is up)
        self.final: LLMServeError | None = None   # set when no further session will be tried
        self.sessions = 0                          # handshakes completed so far
        self._ready = threading.Event()
        # Re-entrant: a live stream the cyclic GC collects inside one of its sections (an allocation there, a
        # raise, sets the GC off) aborts its request, a send on this transport from the same thread.
        self._lock = threading.RLock()
        self._routes: dict[str, object] = {}
        self._stats_waiters: dict[int, object] = {}
        self._nonces = itertools.count(1)
        self._outbox: collections.deque[bytes] = collections.deque()
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        # Guards the pipe's fds: once closed, their numbers can be reused by anything in the process (another
        # socket, a ZMQ context), so a late wakeup must never write to them. Re-entrant, as _lock is: the cyclic
        # GC may collect a live stream inside it (a full pipe's exception allocates), whose abort wakes again.
        self._fd_lock = threading.RLock()
        self._fds_open = True
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sock = self._monitor = None
        self._open_socket()
        self._thread = threading.Thread(target=self._run, name="llmserve-client-io", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) -----------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> Welcome:
        """Block until the first handshake completed; raise the transport's death otherwise."""
        self._ready.wait(None if timeout is None else min(timeout, threading.TIMEOUT_MAX))   # inf: no limit
        if self.welcome is None:
            raise self.dead or HandshakeTimeoutError(f"no handshake from a core at {self.endpoint}")
        return self.welcome

    def send(self, msg) -> None:
        frame = encode(msg)
        # Under the lock, so a frame is either queued before a session ends (and dropped with it) or refused:
        # a request of a dead session must never reach the next core.
        with self._lock:
            if self.dead is not None:
                raise self.dead
            self._outbox.append(frame)
        self._wake()

    def register(self, request_id: str, sink) -> None:
        """Route this request's outputs to sink.put(item) until its final output or error."""
        with self._lock:
            if self.dead is not None:
                raise self.dead
            if request_id in self._routes:
                raise ValueError(f"request_id: {request_id!r} is already in flight on this client")
            self._routes[request_id] = sink

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._routes.pop(request_id, None)

    def request_stats(self, sink) -> int:
        with self._lock:
            if self.dead is not None:
                raise self.dead
            nonce = next(self._nonces)
            self._stats_waiters[nonce] = sink
        self.send(StatsRequest(nonce=nonce))
        return nonce

    def drop_stats_waiter(self, nonce: int) -> None:
        with self._lock:
            self._stats_waiters.pop(nonce, None)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._wake()
        self._thread.join(timeout=2.0)

    def _wake(self) -> None:
        with self._fd_lock:
            if not self._fds_open:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass   # pipe full: a wakeup is pending anyway

    # ---- transport thread --------------------------------------------------------------------------
    def _open_socket(self) -> None:
        ctx = zmq.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        # A unique address: pyzmq's default derives it from the socket's fd number, which a later socket in
        # this process can reuse while the old monitor endpoint is still being torn down.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED,
                                                      addr=f"inproc://llmserve-client-monitor-{uuid.uuid4().hex}")
        self._sock.connect(self.endpoint)

    def _close_socket(self, linger: int = 0) -> None:
        # Stop the monitor before closing either end of it, then close the socket.
        if self._sock is None:
            return
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(linger=linger)
        self._sock = self._monitor = None

    def _run(self) -> None:
        try:
            self._sessions()
        except Exception as e:   # a bug here must still release every waiter
            log.exception("client transport failed")
            self._die(EngineDeadError(f"client transport failed: {e!r}"), final=True)
        finally:
            # A little linger lets a closing client's Goodbye reach the core; a dead core gets none.
            linger = 200 if self._closing and self.dead is None else 0
            self._die(EngineDeadError("client closed"), final=True)
            self._close_socket(linger)
            with self._fd_lock:
                self._fds_open = False
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _sessions(self) -> None:
        """Run sessions until the client closes or something ends the transport for good."""
        deadline = time.monotonic() + self.connect_timeout
        pause = RECONNECT_BACKOFF_S[0]
        while True:
            outcome = self._session(deadline if self.model_info is None else None)
            if outcome == "closed" or self.final is not None:
                return
            if outcome == "ended":
                if not self.reconnect:
                    self.final = self.dead
                    return
                pause = RECONNECT_BACKOFF_S[0]   # a session was up: the next one may come back quickly
            else:   # "retry": the connection dropped before a welcome
                pause = min(pause * 2, RECONNECT_BACKOFF_S[1])
            self._close_socket()
            if self._pause(pause):
                return
            self._open_socket()

    def _pause(self, seconds: float) -> bool:
        """Sleep, waking for close(); True when closing."""
        end = time.monotonic() + seconds
        while not self._closing and time.monotonic() < end:
            zmq.select([self._wake_r], [], [], max(0.0, min(0.1, end - time.monotonic())))
            self._drain_wake_pipe()
        return self._closing

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _session(self, deadline: float | None) -> str:
        """One socket's life: hello, welcome, traffic. Returns "closed" (the client closes), "ended" (a
        session that was up has died) or "retry" (the connection dropped before any welcome)."""
        sock, poller = self._sock, zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION, client_name=self.client_name)))
        welcomed = False
        last_recv = last_ping = time.monotonic()
        while True:
            events = dict(poller.poll(timeout=100))
            now = time.monotonic()
            if self._wake_r in events:
                self._drain_wake_pipe()
            if welcomed:
                while self._outbox:
                    sock.send(self._outbox.popleft(), copy=False)
            if self._closing:
                if welcomed and self.dead is None:
                    sock.send(encode(Goodbye()))
                return "closed"
            if sock in events:
                # Drain what is queued, but for one slice at a time: a core that sends faster than this
                # thread reads must not keep it from its outbox and its pings (the core drops a client
                # silent for client_timeout) for as long as the flood lasts. Each output is stamped when
                # it was read, not when the drain began.
                slice_end = now + DRAIN_SLICE_S
                while now < slice_end:
                    try:
                        frame = sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    now = last_recv = time.monotonic()
                    welcome = self._dispatch(frame.buffer, now, welcomed)
                    if welcome:
                        welcomed = True
                    if self.final is not None or (welcomed and self.dead is not None):
                        return "ended"
            if self._monitor in events:
                evt = parse_monitor_message(self._monitor.recv_multipart())
                if evt["event"] == zmq.EVENT_DISCONNECTED:
                    if welcomed:
                        self._die(EngineDeadError(f"connection to the core at {self.endpoint} was lost"))
                        return "ended"
                    # A core that went away before answering took our hello with it: say it again to the
                    # next one on a fresh socket.
                    return "retry"
            if not welcomed:
                if deadline is not None and now > deadline:
                    self._die(HandshakeTimeoutError(
                        f"no core answered at {self.endpoint} within {self.connect_timeout:.0f} s"), final=True)
                    return "ended"
                continue
            if now - last_recv > self.heartbeat_timeout:
                self._die(EngineDeadError(f"no word from the core for {now - last_recv:.1f} s "
                                          f"(heartbeat timeout {self.heartbeat_timeout} s)"))
                return "ended"
            ping_every = min(1.0, self.welcome.client_timeout_s / 4)
            if now - last_ping >= ping_every:
                sock.send(encode(Ping(time=now)))
                last_ping = now

    def _dispatch(self, frame, now: float, welcomed: bool) -> bool:
        """Handle one core message; True when it was the welcome that opens this session."""
        try:
            msg = decode_core(frame)
        except Exception as e:
            log.error("undecodable message from the core: %s", e)
            return False
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                with self._lock:
                    sink = (self._routes.pop(out.request_id, None) if out.finish_reason is not None
                            else self._routes.get(out.request_id))
                if sink is not None:
                    sink.put(("output", out, msg.time, now))
        elif isinstance(msg, PooledBatch):
            for out in msg.outputs:
                with self._lock:
                    sink = self._routes.pop(out.request_id, None)
                if sink is not None:
                    sink.put(("pooled", out, msg.time, now))
        elif isinstance(msg, Heartbeat):
            pass
        elif isinstance(msg, RequestError):
            with self._lock:
                sink = self._routes.pop(msg.request_id, None)
            if sink is not None:
                sink.put(("error", msg))
            else:
                log.warning("core rejected request %r: %s: %s", msg.request_id, msg.field, msg.message)
        elif isinstance(msg, StatsReply):
            with self._lock:
                sink = self._stats_waiters.pop(msg.nonce, None)
            if sink is not None:
                sink.put(("stats", msg.stats))
        elif isinstance(msg, Welcome):
            return not welcomed and self._on_welcome(msg)
        elif isinstance(msg, EngineError):
            if msg.fatal:
                if welcomed or self.model_info is not None:
                    self._die(EngineDeadError(f"core: {msg.message}"))
                else:
                    self._die(ProtocolError(f"core: {msg.message}"), final=True)
            else:
                log.warning("core: %s", msg.message)
        elif isinstance(msg, Shutdown):
            self._die(EngineDeadError(f"core shut down{': ' + msg.reason if msg.reason else ''}"))
        return False

    def _on_welcome(self, msg: Welcome) -> bool:
        if msg.protocol_version != PROTOCOL_VERSION:
            self._die(ProtocolError(f"core speaks protocol {msg.protocol_version}, "
                                    f"this client {PROTOCOL_VERSION}"), final=True)
            return False
        if self.model_info is not None:
            diff = model_difference(self.model_info, msg.model_info)
            if diff is not None:
                self._die(ModelChangedError(f"the core at {self.endpoint} came back serving another model "
                                            f"({diff}); make a new client"), final=True)
                return False
            log.info("reconnected to the core at %s (pid %d)", self.endpoint, msg.core_pid)
        else:
            self.model_info = msg.model_info
        self.welcome = msg
        # Never declare a healthy core dead between two of its heartbeats.
        self.heartbeat_timeout = max(self.heartbeat_timeout, 4 * msg.heartbeat_interval_s)
        with self._lock:
            self.dead = None
            self.sessions += 1
        self._ready.set()
        return True

    def _die(self, exc: LLMServeError, final: bool = False) -> None:
        """End the session: every waiting call gets exc, and calls fail with it until the next session."""
        with self._lock:
            if final and self.final is None:
                self.final = exc
            if self.dead is not None:
                if final:
                    self.dead = self.final
                return
            self.dead = exc
            sinks = list(self._routes.values()) + list(self._stats_waiters.values())
            self._routes.clear()
            self._stats_waiters.clear()
            self._outbox.clear()
        for sink in sinks:
            sink.put(("dead", exc))
        self._ready.set()
