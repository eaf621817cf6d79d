"""The busy loop: the only thread that touches the engine.

Each turn drains the input queue (add/abort requests, forget vanished clients, answer stats), runs one
engine step when there is work, and queues the step's outputs for the output thread. It never touches a
socket and never encodes; when idle it blocks on the input queue (with a short timeout to notice shutdown),
and so it does while its only requests wait for their grammars to compile: the compile thread wakes it with
a GrammarReady item (a loop stepping meanwhile would burn a core and starve the compiler of the GIL).

Engine request ids are "<client routing id hex>/<serial>/<client's request id>", so clients may reuse each
other's ids, and a client may reuse its own once a request has ended in the daemon but not yet in the engine
(an abort's final output comes from the next step: with the bare id it would end the new request). `live`
maps them back and guarantees each accepted request exactly one final output.
"""
from __future__ import annotations

import itertools
import logging
import queue
import time
from dataclasses import dataclass

from llmserve_proto import EngineError, Pool, RequestMetrics, Shutdown, ValidationError
from llmserve_core.server.events import (AbortRequests, Broadcast, ClientGone, ErrorReply, GrammarReady, NewRequest,
                                         SocketFailed, StatsQuery, StatsResult, StepResult)
from llmserve_core.server.log_safety import printable

log = logging.getLogger("llmserve_core.server")

# A step that raises fails the requests it held and the core serves on; this many failing in a row mean
# the engine itself is broken (a lost device, say), and the core exits.
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class Live:
    client: bytes
    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    num_generated: int = 0
    aborted: bool = False


class BusyLoop:
    def __init__(self, engine, in_q: queue.SimpleQueue, out_q: queue.SimpleQueue, *, log_interval: float = 10.0,
                 drain_timeout: float = 30.0, num_clients=lambda: 0, stop=None):
        self.engine = engine
        self.in_q, self.out_q = in_q, out_q
        self.log_interval = log_interval
        self.drain_timeout = drain_timeout
        self.num_clients = num_clients
        self.stop_event = stop                               # a threading.Event: set = drain as on SIGTERM
        self.live: dict[str, Live] = {}
        self.by_client: dict[bytes, dict[str, str]] = {}     # client -> its request id -> engine id
        self._serials = itertools.count()
        self.stop_reason: str | None = None                  # set (from a signal handler) to start draining
        self.force_stop = False                              # set by a second signal: stop draining now
        self.fatal: str | None = None
        self.counters = dict(requests_received=0, requests_finished=0, requests_rejected=0,
                             requests_aborted_by_client=0, requests_aborted_disconnect=0,
                             requests_aborted_shutdown=0, requests_failed=0, clients_gone=0)
        self.consecutive_step_failures = 0
        self.start_time = time.monotonic()
        self._last_log = (self.start_time, 0, 0, 0)          # time, prompt tokens, generated tokens, steps
        self._idle_logged = False
        grammars = getattr(engine, "grammars", None)
        if grammars is not None:
            grammars.listeners.append(lambda: in_q.put(GrammarReady()))

    # ---- inputs -------------------------------------------------------------------------------------
    def _drain_inputs(self, block: bool) -> None:
        try:
            item = self.in_q.get(timeout=0.1) if block else self.in_q.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self.in_q.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        if isinstance(item, NewRequest):
            self._add(item)
        elif isinstance(item, AbortRequests):
            mine = self.by_client.get(item.client, {})
            for rid in item.request_ids:
                eid = mine.get(rid)
                lv = self.live.get(eid) if eid is not None else None
                if lv is not None and not lv.aborted:   # it stays live until that output: count it once
                    lv.aborted = True
                    self.counters["requests_aborted_by_client"] += 1
                    self.engine.abort(eid)      # its final "abort" output comes from the next step
        elif isinstance(item, ClientGone):
            self._forget(item.client)
        elif isinstance(item, StatsQuery):
            self.out_q.put(StatsResult(item.client, item.nonce, self.stats()))
        elif isinstance(item, SocketFailed):
            self.fatal = item.reason
        # GrammarReady only wakes the loop: the next step finds the compiled grammar.

    def _add(self, item: NewRequest) -> None:
        msg = item.msg
        mine = self.by_client.setdefault(item.client, {})
        if msg.request_id in mine:
            self._reject(item.client, msg.request_id, "request_id", "already in flight on this connection")
            return
        eid = f"{item.client.hex()}/{next(self._serials)}/{msg.request_id}"
        add = self.engine.add_pooling_request if isinstance(msg, Pool) else self.engine.add_request
        try:
            # Fair shares and queue caps go by (connection, user): see PROTOCOL.md, "Fair shares".
            add(eid, msg.prompt_token_ids, msg.params, client=(item.client, msg.user))
        except ValidationError as e:       # also QueueFull: the client's waiting queue is at its cap
            self._reject(item.client, msg.request_id, e.field, e.message)
            return
        except Exception as e:      # an engine bug must not take the core down for one request
            log.exception("add_request failed for %s", printable(eid))
            self._reject(item.client, msg.request_id, "", f"internal error: {e!r}")
            return
        self.counters["requests_received"] += 1
        mine[msg.request_id] = eid
        self.live[eid] = Live(item.client, msg.request_id, item.arrival_time, len(msg.prompt_token_ids))

    def _reject(self, client: bytes, rid: str, field: str, message: str) -> None:
        self.counters["requests_rejected"] += 1
        self.out_q.put(ErrorReply(client, rid, field, message))

    def _forget(self, client: bytes) -> None:
        """A client went away: abort its requests so their KV blocks are freed, and send it nothing more."""
        mine = self.by_client.pop(client, {})
        self.counters["clients_gone"] += 1
        for eid in mine.values():
            self.live.pop(eid, None)
            self.engine.abort(eid)
            self.counters["requests_aborted_disconnect"] += 1
        if mine:
            log.info("aborted %d request(s) of departed client %s", len(mine), client.hex())

    def _end(self, eid: str) -> Live | None:
        """Forget a request that has had its final item."""
        lv = self.live.pop(eid, None)
        if lv is not None:
            mine = self.by_client.get(lv.client)
            if mine is not None:
                mine.pop(lv.request_id, None)
                if not mine:
                    del self.by_client[lv.client]
        return lv

    # ---- stepping -----------------------------------------------------------------------------------
    def _step(self) -> None:
        outs = self.engine.step()
        now = time.monotonic()
        items = []
        for so in outs:
            lv = self.live.get(so.request_id)
            if lv is None:
                continue    # its client is gone
            if so.new_token_ids:
                lv.num_generated += len(so.new_token_ids)
                if lv.first_token_time is None:
                    lv.first_token_time = now
            metrics = None
            if so.finish_reason is not None:
                metrics = RequestMetrics(arrival_time=lv.arrival_time, first_token_time=lv.first_token_time,
                                         finish_time=now, num_prompt_tokens=so.num_prompt_tokens or lv.num_prompt_tokens,
                                         num_cached_tokens=so.num_cached_tokens, num_generated_tokens=lv.num_generated)
                self._end(so.request_id)
                self.counters["requests_finished"] += 1
            items.append((lv.client, lv.request_id, so, metrics))
        if items:
            self.out_q.put(StepResult(getattr(self.engine, "num_steps", 0), now, items))

    def run(self, begin_drain=lambda: None) -> int:
        """Serve until stop_reason is set and the drain ends; returns the process exit code."""
        deadline = None
        while True:
            if self.fatal is not None:
                return self._die(self.fatal)
            self._drain_inputs(block=not self._can_step())
            if self.stop_event is not None and self.stop_event.is_set() and self.stop_reason is None:
                self.stop_reason = "asked to stop"
            if self.stop_reason is not None and deadline is None:
                log.info("%s: draining %d request(s) for up to %.0f s", self.stop_reason, len(self.live),
                         self.drain_timeout)
                begin_drain()
                deadline = time.monotonic() + self.drain_timeout
            if deadline is not None and (not self.live or time.monotonic() > deadline or self.force_stop):
                self._abort_all()
                self.out_q.put(Broadcast(Shutdown(reason=self.stop_reason or ""), last=True))
                log.info("shut down")
                return 0
            if self._can_step():
                try:
                    self._step()
                    self.consecutive_step_failures = 0
                except Exception as e:
                    log.exception("engine step failed")
                    if getattr(e, "fatal", False):       # e.g. a lost tensor-parallel worker
                        return self._die(str(e))
                    self.consecutive_step_failures += 1
                    if self.consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        return self._die(f"engine step failed {self.consecutive_step_failures} times in a row: {e!r}")
                    self._fail_step(e)
            self._maybe_log()

    def _can_step(self) -> bool:
        """A step would do something: not when every request waits for its grammar (see Engine.stalled)."""
        return self.engine.has_unfinished() and not getattr(self.engine, "stalled", False)

    def _fail_step(self, error: Exception) -> None:
        """The step raised: its requests end with a request_error; the rest of the engine serves on."""
        failed = self.engine.fail_step()
        log.error("engine step failed: %d request(s) in it ended with an error", len(failed))
        for eid in failed:
            lv = self._end(eid)
            if lv is None:
                continue    # its client is gone
            self.counters["requests_failed"] += 1
            self.out_q.put(ErrorReply(lv.client, lv.request_id, "", f"internal error: the engine step running "
                                                                     f"this request failed: {error!r}"))

    def _abort_all(self) -> None:
        if self.live:
            log.info("aborting %d request(s) still running", len(self.live))
        for eid in list(self.live):
            self.engine.abort(eid)
            self.counters["requests_aborted_shutdown"] += 1
        while self.live and self.engine.has_unfinished():
            self._step()

    def _die(self, reason: str) -> int:
        self.out_q.put(Broadcast(EngineError(message=reason, fatal=True), last=True))
        return 1

    # ---- reporting ----------------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        """A stop was asked for (a signal, or the stop event): new requests are refused from now on."""
        return self.stop_reason is not None or (self.stop_event is not None and self.stop_event.is_set())

    def stats(self) -> dict:
        s = dict(self.engine.stats())
        s.update(self.counters)
        s.update(num_clients=self.num_clients(), draining=self.draining, live_requests=len(self.live),
                 uptime_s=round(time.monotonic() - self.start_time, 3))
        return s

    def _maybe_log(self) -> None:
        now = time.monotonic()
        t0, p0, g0, n0 = self._last_log
        if self.log_interval <= 0 or now - t0 < self.log_interval:
            return
        s = self.engine.stats()
        p, g, n = s.get("total_prompt_tokens", 0), s.get("total_generated_tokens", 0), s.get("num_steps", 0)
        self._last_log = (now, p, g, n)
        idle = n == n0 and not self.live
        if idle and self._idle_logged:
            return      # one line says "idle"; repeating it says nothing
        self._idle_logged = idle
        dt = now - t0
        log.info("prompt %.1f tok/s, generation %.1f tok/s, %.1f steps/s | running %d, waiting %d | "
                 "KV usage %.1f%% (%d used, %d cached, %d free of %d blocks) | prefix hit rate %.1f%% | clients %d",
                 (p - p0) / dt, (g - g0) / dt, (n - n0) / dt, s.get("running", 0), s.get("waiting", 0),
                 100.0 * s.get("kv_usage", 0.0), s.get("used_kv_blocks", 0), s.get("cached_kv_blocks", 0),
                 s.get("free_kv_blocks", 0), s.get("total_kv_blocks", 0),
                 100.0 * s.get("prefix_hit_rate", 0.0), self.num_clients())
