"""llmserve-core's process: load the engine, bind the socket, run the three threads, drain on a signal.

Threads: socket thread (owns the ROUTER: recv, decode, check, send, heartbeats, client liveness), busy loop
(main thread: the engine), output thread (encode per client). Binding happens only after the model is
loaded, so a client's handshake completing means the core is ready.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass

import zmq

from llmserve_proto import PROTOCOL_VERSION, EngineError, ModelInfo, Welcome
from llmserve_proto.endpoint import (check_listen_endpoint, default_endpoint, ensure_private_dir, ipc_path,
                                     runtime_dir)
from llmserve_core.server.busy_loop import BusyLoop
from llmserve_core.server.events import Broadcast
from llmserve_core.server.output_thread import OutputThread
from llmserve_core.server.socket_thread import SocketThread, bind_router

log = logging.getLogger("llmserve_core.server")


@dataclass
class DaemonConfig:
    listen: str | None = None           # ipc://PATH or tcp://HOST:PORT; None: the default private ipc socket
    allow_remote: bool = False          # let tcp bind a non-loopback address
    heartbeat_interval: float = 0.5     # core -> client heartbeat period (s)
    client_timeout: float = 15.0        # a client silent this long is dropped and its requests aborted (s)
    drain_timeout: float = 30.0         # on SIGTERM/SIGINT, how long running requests may finish (s)
    log_interval: float = 10.0          # periodic stats log line; 0 disables
    max_unread_bytes: int = 16 * 1024 * 1024   # a client with more unread than this is disconnected


def prepare_endpoint(cfg: DaemonConfig) -> str:
    """Check the endpoint can be bound, before the (slow) model load: raises ValueError starting "listen:"
    with one line saying what is wrong."""
    endpoint = check_listen_endpoint(cfg.listen or default_endpoint(), cfg.allow_remote)
    path = ipc_path(endpoint)
    if path is not None:
        parent = os.path.dirname(os.path.abspath(path))
        try:
            if cfg.listen is None or parent == runtime_dir():
                ensure_private_dir(parent)
            else:
                os.makedirs(parent, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ValueError(f"listen: cannot use directory {parent}: {e.strerror or e}") from None
        if _someone_listening(path):
            raise ValueError(f"listen: another process is already serving at {endpoint}")
    _trial_bind(endpoint)
    return endpoint


def _trial_bind(endpoint: str) -> None:
    """Bind and close a socket set up as the real one will be, so a port in use, a directory we may not
    write or an address this host lacks fails now rather than after loading the model."""
    ctx = zmq.Context()
    try:
        router = bind_router(ctx, endpoint)
        router.close(linger=0)
    except zmq.ZMQError as e:
        raise ValueError(f"listen: cannot bind {endpoint}: {zmq.strerror(e.errno)}") from None
    finally:
        ctx.term()          # waits for the socket to close, so the real bind finds the address free
    path = ipc_path(endpoint)
    if path is not None and os.path.exists(path):
        os.unlink(path)


def _someone_listening(path: str) -> bool:
    if not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False    # a stale file from a core that died; binding replaces it
    finally:
        s.close()


def model_info_of(engine) -> ModelInfo:
    mi, cfg = engine.model_info, engine.config
    path = os.path.abspath(mi.model)
    return ModelInfo(model=path, name=os.path.basename(path.rstrip("/")), vocab_size=mi.vocab_size,
                     max_model_len=mi.max_model_len, eos_token_ids=list(mi.eos_token_ids),
                     speculative=bool(mi.speculative), speculative_model=cfg.speculative_model,
                     tokenizer=os.path.abspath(cfg.tokenizer) if cfg.tokenizer else None,
                     runner=mi.runner, tasks=list(mi.tasks), hidden_size=mi.hidden_size)


def max_request_tokens(engine, max_model_len: int) -> int:
    """Prompt + max_tokens one request may ask for: max_model_len, unless the whole KV pool holds less."""
    bm = engine.block_manager
    return min(max_model_len, bm.num_blocks * bm.block_size - engine.lookahead)


def serve(engine, cfg: DaemonConfig, endpoint: str, stop: threading.Event | None = None) -> int:
    """Serve `engine` at `endpoint` until SIGTERM/SIGINT (or `stop` is set: signals reach only the main
    thread, so a serve() embedded in another thread is stopped this way); returns the exit code."""
    info = model_info_of(engine)
    welcome = Welcome(protocol_version=PROTOCOL_VERSION, model_info=info, heartbeat_interval_s=cfg.heartbeat_interval,
                      client_timeout_s=cfg.client_timeout, core_pid=os.getpid(),
                      max_request_tokens=max_request_tokens(engine, info.max_model_len),
                      kv_block_size=engine.block_manager.block_size)
    ctx = zmq.Context()
    in_q: queue.SimpleQueue = queue.SimpleQueue()
    out_q: queue.SimpleQueue = queue.SimpleQueue()
    router = bind_router(ctx, endpoint)
    pair_addr = f"inproc://llmserve-outputs-{os.getpid()}"
    sock_thread = SocketThread(ctx, router, pair_addr, in_q, welcome, cfg.heartbeat_interval, cfg.client_timeout,
                               cfg.max_unread_bytes)
    out_thread = OutputThread(ctx, pair_addr, out_q, in_q)
    busy = BusyLoop(engine, in_q, out_q, log_interval=cfg.log_interval, drain_timeout=cfg.drain_timeout,
                    num_clients=lambda: len(sock_thread.clients), stop=stop)

    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        if busy.stop_reason is None:
            busy.stop_reason = f"received {name}"
        else:
            log.info("received %s again: aborting what is left now", name)
            busy.force_stop = True

    # Signal handlers can only be installed from the main thread (tests run serve() in a thread).
    in_main = threading.current_thread() is threading.main_thread()
    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)} if in_main else {}
    sock_thread.start()
    out_thread.start()
    driver = getattr(getattr(engine, "tp", None), "driver", None)
    if driver is not None:
        def on_worker_lost(reason: str) -> None:
            # The busy loop may be stuck in a collective with the dead rank: tell the clients from here,
            # give the output thread a moment to send it, and exit non-zero.
            log.error("%s: the engine cannot continue", reason)
            out_q.put(Broadcast(EngineError(message=reason, fatal=True), last=True))
            out_thread.join(timeout=3.0)
            driver.workers.stop(timeout=0)
            os._exit(1)
        driver.watch(on_worker_lost)
    log.info("ready: serving %s (vocab %d, max_model_len %d) at %s", info.model, info.vocab_size,
             info.max_model_len, endpoint)
    try:
        code = busy.run(begin_drain=lambda: setattr(sock_thread, "accepting", False))
    finally:
        out_thread.join(timeout=5.0)
        sock_thread.join(timeout=5.0)
        router.close(linger=500)
        ctx.destroy(linger=0)
        path = ipc_path(endpoint)
        if path and os.path.exists(path):
            os.unlink(path)
        for s, h in old_handlers.items():
            signal.signal(s, h)
        if driver is not None:
            engine.close()
    return code


class _StopWhileLoading(BaseException):
    """Not an Exception: the loading code's error handling must not take a stop for a failure."""


def _stop_while_loading(signum, _frame):
    raise _StopWhileLoading(signal.Signals(signum).name)


def _prepare_grammars(engine) -> None:
    """Build the grammar compiler for the vocabulary before saying ready, so no structured request pays for it."""
    from llmserve_core.engine.grammar import grammars_available
    if not grammars_available(engine.grammars.tokenizer_dir):
        return
    t0 = time.monotonic()
    error = engine.grammars.prepare()
    if error is not None:
        log.warning("structured outputs are unavailable: the grammar compiler failed to build: %r", error)
    else:
        log.info("grammar compiler built in %.1f s", time.monotonic() - t0)


def run_daemon(engine_config, cfg: DaemonConfig) -> int:
    """Resolve the endpoint, load the engine, serve. Endpoint problems surface before the (slow) load; a
    SIGTERM/SIGINT during the load is a clean exit too."""
    from llmserve_core.distributed.launch import start_engine
    endpoint = prepare_endpoint(cfg)
    old = {s: signal.signal(s, _stop_while_loading) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        t0 = time.monotonic()
        engine = start_engine(engine_config)
        _prepare_grammars(engine)
        log.info("engine loaded in %.1f s: %s", time.monotonic() - t0, engine.stats())
    except _StopWhileLoading as e:
        log.info("received %s while loading the model: exiting", e)
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return serve(engine, cfg, endpoint)
