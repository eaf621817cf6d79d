"""The cores a client serves over: one Transport per endpoint, the router's choice per request, and the
in-flight accounting the router's load comes from.

One endpoint behaves exactly as a client always did. Over several (data parallelism):
- At connect every core must answer the handshake and announce the same model (MODEL_IDENTITY), else
  ModelMismatchError. Each transport then reconnects by itself; a core that comes back re-enters rotation
  once its handshake passed the model check that transport already makes.
- A request goes where the router says among the cores whose session is up; when a core dies, only its
  own in-flight requests fail (its transport delivers EngineDeadError to their sinks) and new requests go
  to the others. Calls fail only when no core is up.
- Load = requests in flight from here + what a core's own stats (polled at most every STATS_REFRESH_S,
  piggybacked on routing) say other clients have running or waiting there.

Request ids: the caller's id is refused only while the caller's own request with that id is live (it has not
yet seen it end). On the wire each request has an id of its own, the caller's with "#<serial>" appended, so
an id is free again the moment its caller saw the request end (a stop string matched here, a stream closed),
though the core may still be finishing the old one: its late outputs go nowhere.
"""
from __future__ import annotations

import itertools
import threading
import time

from llmserve_proto import Abort, Generate, ValidationError, Welcome, default_endpoint
from llmserve_proto.messages import CLIENT_BOUNDS, MAX_REQUEST_ID_LEN
from llmserve_client.errors import EngineDeadError, LLMServeError, ModelMismatchError, RequestError
from llmserve_client.router import Router
from llmserve_client.transport import Transport, model_difference

STATS_REFRESH_S = 1.0     # how stale a core's reported load may get before routing asks again
STATS_GIVE_UP_S = 10.0    # a stats query unanswered this long (rate-limited, lost) is asked again


class Cores:
    def __init__(self, endpoints: list[str], **transport_args):
        if not endpoints:
            raise ValueError("endpoint: need at least one endpoint")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"endpoint: listed twice: {sorted({e for e in endpoints if endpoints.count(e) > 1})}")
        self.endpoints = list(endpoints)
        self.transports: list[Transport] = []
        try:
            for ep in self.endpoints:
                self.transports.append(Transport(ep, **transport_args))
        except BaseException:
            self.close()
            raise
        self.router: Router | None = None
        # Re-entrant: a live stream the cyclic GC collects inside one of these sections (an allocation there
        # sets the GC off) releases its request, which takes the lock again in the same thread.
        self._lock = threading.RLock()
        self._in_flight: dict[str, WireRequest] = {}      # wire id -> request, until the core ended it
        self._callers: dict[str, WireRequest] = {}        # caller's id -> request, until the caller saw it end
        self._serials = itertools.count(1)
        self._counts = [0] * len(self.endpoints)         # requests in flight from here, per core
        self.routed = [0] * len(self.endpoints)          # requests sent to each core since the start
        self._foreign = [0] * len(self.endpoints)        # others' running + waiting, from the core's stats
        self._stats_asked = [0.0] * len(self.endpoints)  # when the last load query went out (0: none pending)
        self._stats_answered = [0.0] * len(self.endpoints)
        self._draining = [False] * len(self.endpoints)   # the core's last stats said it refuses new requests

    @property
    def single(self) -> bool:
        return len(self.transports) == 1

    # ---- connecting ------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> Welcome:
        """Wait for every core's handshake; check they serve one model. Returns the first core's welcome."""
        welcomes = [t.wait_ready(timeout) for t in self.transports]
        first = welcomes[0]
        for ep, w in zip(self.endpoints[1:], welcomes[1:]):
            diff = model_difference(first.model_info, w.model_info)
            if diff is not None:
                raise ModelMismatchError(f"the core at {ep} serves another model than the one at "
                                         f"{self.endpoints[0]} ({diff}); every core must serve the same model")
        sizes = [w.kv_block_size for w in welcomes if w.kv_block_size > 0]
        self.router = Router(self.endpoints, min(sizes, default=0))
        return first

    @property
    def max_request_tokens(self) -> int:
        """Prompt + max_tokens every core can hold (0 before the handshake)."""
        limits = [w.max_request_tokens or w.model_info.max_model_len
                  for w in (t.welcome for t in self.transports) if w is not None]
        return min(limits) if len(limits) == len(self.transports) else 0

    # ---- liveness ------------------------------------------------------------------------------------------
    @property
    def dead(self) -> LLMServeError | None:
        """Why no call can be served now (no core up), else None."""
        errors = [t.dead for t in self.transports]
        if any(e is None for e in errors):
            return None
        if self.single:
            return errors[0]
        return EngineDeadError("no core is up: " + "; ".join(f"{ep}: {e}" for ep, e in zip(self.endpoints, errors)))

    @property
    def final(self) -> LLMServeError | None:
        """Why no core will ever serve again (all transports ended for good), else None."""
        finals = [t.final for t in self.transports]
        if any(f is None for f in finals):
            return None
        if self.single:
            return finals[0]
        return type(finals[0])("; ".join(f"{ep}: {f}" for ep, f in zip(self.endpoints, finals)))

    # ---- requests ----------------------------------------------------------------------------------------
    def open(self, request_id: str, token_ids: list[int], sink) -> "WireRequest":
        """Choose a core for the request and route its outputs to sink; the caller sends the Generate on the
        request's transport (and calls close_request if that fails)."""
        with self._lock:
            if request_id in self._callers:
                raise ValueError(f"request_id: {request_id!r} is already in flight on this client")
            up = [t.dead is None for t in self.transports]
            if not any(up):
                raise self.dead or EngineDeadError("no core is up")
            serving = [u and not d for u, d in zip(up, self._draining)]
            up = serving if any(serving) else up      # a draining core refuses the request: others first
            loads = [c + f for c, f in zip(self._counts, self._foreign)]
            i = self.router.pick(token_ids, loads, up) if not self.single else 0
            req = WireRequest(self, request_id, wire_request_id(request_id, next(self._serials)), i, sink)
            self._in_flight[req.wire_id] = self._callers[request_id] = req
            self._counts[i] += 1
            self.routed[i] += 1
        try:
            req.transport.register(req.wire_id, req)
        except BaseException:
            self.close_request(req)
            raise
        return req

    def close_request(self, req: "WireRequest") -> None:
        """The request is over in the core (final output, error, core death), or was never sent."""
        with self._lock:
            if self._in_flight.pop(req.wire_id, None) is None:
                return
            self._counts[req.index] -= 1
            self._forget_caller(req)
        req.transport.unregister(req.wire_id)

    def release(self, req: "WireRequest") -> None:
        """The caller saw the request end: its id may name a new request at once."""
        with self._lock:
            self._forget_caller(req)

    def _forget_caller(self, req: "WireRequest") -> None:
        if self._callers.get(req.request_id) is req:
            del self._callers[req.request_id]

    def _is_current(self, req: "WireRequest") -> bool:
        with self._lock:
            return req.wire_id in self._in_flight

    def find(self, request_id: str) -> "WireRequest | None":
        """The caller's live request with this id."""
        with self._lock:
            return self._callers.get(request_id)

    def in_flight(self) -> list[int]:
        with self._lock:
            return list(self._counts)

    # ---- load from the cores' stats ----------------------------------------------------------------------
    def refresh_loads(self) -> None:
        """Ask stale cores for their queue lengths. Called after a request went out, so the core has every
        request counted in own_when_asked before it reads the query (one socket keeps order): what it
        reports beyond those is other clients' load."""
        if self.single:
            return
        now = time.monotonic()
        for i, t in enumerate(self.transports):
            asked = self._stats_asked[i]
            pending = asked and now - asked < STATS_GIVE_UP_S
            if pending or now - self._stats_answered[i] < STATS_REFRESH_S or t.dead is not None:
                continue
            self._stats_asked[i] = now
            try:
                t.request_stats(_LoadSink(self, i, self.in_flight()[i]))
            except LLMServeError:
                self._stats_asked[i] = 0.0

    def _on_load(self, i: int, stats: dict, own_when_asked: int) -> None:
        queued = int(stats.get("running", 0) or 0) + int(stats.get("waiting", 0) or 0)
        self._foreign[i] = max(0, queued - own_when_asked)
        self._draining[i] = bool(stats.get("draining"))
        self._stats_asked[i], self._stats_answered[i] = 0.0, time.monotonic()

    def close(self) -> None:
        for t in self.transports:
            t.close()


def endpoint_list(endpoint: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """The endpoints a client was given: one, several, or None for the default socket."""
    if endpoint is None:
        return [default_endpoint()]
    if isinstance(endpoint, str):
        return [endpoint]
    endpoints = list(endpoint)
    if not endpoints or not all(isinstance(e, str) and e for e in endpoints):
        raise ValueError(f"endpoint: expected an endpoint string or a non-empty list of them, got {endpoint!r}")
    return endpoints


def wire_request_id(request_id: str, serial: int) -> str:
    """The id a request goes by on the wire: unique in this client, and still naming the caller's id in the
    core's logs (cut short to fit the bound)."""
    tag = f"#{serial}"
    return request_id[:MAX_REQUEST_ID_LEN - len(tag)] + tag


def open_request(cores: Cores, request_id: str, ids: list[int], params, sink, user: str = "",
                 message=Generate) -> "WireRequest":
    """Route a request to a core and send it as `message` (Generate, or Pool with PoolingParams; shared by
    both clients). A core found dead on the way is left out and the next choice tried: nothing was sent to it.
    `user`: whom it is for within this connection (the core's fair shares go by connection and user)."""
    try:
        for name, value in (("request_id", request_id), ("user", user)):
            CLIENT_BOUNDS[Generate][name].check(name, value)
    except ValidationError as e:
        raise RequestError(e.field, e.message, request_id) from None
    tries = len(cores.transports)
    while True:
        try:
            req = cores.open(request_id, ids, sink)
        except ValueError as e:
            raise RequestError("request_id", str(e).split(": ", 1)[-1], request_id) from None
        try:
            req.transport.send(message(request_id=req.wire_id, prompt_token_ids=ids, params=params, user=user))
        except BaseException as e:
            cores.close_request(req)
            tries -= 1
            if not isinstance(e, EngineDeadError) or tries == 0 or cores.dead is not None:
                raise
            continue
        cores.refresh_loads()
        return req


class WireRequest:
    """One request as sent to one core, and its sink there: it tells Cores when the request is over (its
    last item passes through here). Items of a request that is over for Cores (a send that failed on a
    dying core and went to another core instead) are dropped, as are those the caller no longer waits for
    (it saw the request end): the caller's queue must not see that core's death, nor an abort's tail."""

    def __init__(self, cores: Cores, request_id: str, wire_id: str, index: int, sink):
        self.cores, self.request_id, self.wire_id, self.index, self.sink = cores, request_id, wire_id, index, sink
        self.transport: Transport = cores.transports[index]
        self.released = False

    def put(self, item) -> None:
        if not self.cores._is_current(self):
            return
        if item[0] != "output" or item[1].finish_reason is not None:
            self.cores.close_request(self)
        if not self.released:
            self.sink.put(item)

    def abort(self) -> None:
        """Ask the core to stop the request; its final output says "abort"."""
        self.transport.send(Abort(request_ids=[self.wire_id]))

    def release(self, abort: bool) -> None:
        """The caller saw the request end (or gave up on it): nothing more reaches it, and its id is free.
        abort: the core may still be generating, so stop it there."""
        self.released = True
        self.cores.release(self)
        if abort:
            try:
                self.abort()
            except LLMServeError:   # the transport is dead (EngineDeadError, or a ProtocolError): nothing runs
                pass


class _LoadSink:
    def __init__(self, cores: Cores, index: int, own_when_asked: int):
        self.cores, self.index, self.own = cores, index, own_when_asked

    def put(self, item) -> None:
        if item[0] == "stats":
            self.cores._on_load(self.index, item[1], self.own)
        else:   # the core died first; its load no longer matters
            self.cores._stats_asked[self.index] = 0.0


def aggregate_stats(endpoints: list[str], replies: list, in_flight: list[int], routed: list[int]) -> dict:
    """One stats dict over several cores: integer counters summed over the cores that answered (a per-core
    setting such as spec_policy_gamma is only meaningful per core), KV usage and prefix hit rate recomputed
    from the sums, num_cores / num_cores_up, and "cores": per core its endpoint, whether it answered, the
    requests in flight from here and routed there so far, and its own stats (or the error). Raises
    EngineDeadError when no core answered."""
    per_core, up = [], []
    for ep, reply, n, r in zip(endpoints, replies, in_flight, routed):
        entry = {"endpoint": ep, "up": isinstance(reply, dict), "in_flight": n, "routed": r}
        if isinstance(reply, dict):
            entry.update(reply)
            up.append(reply)
        else:
            entry["error"] = str(reply) or type(reply).__name__
        per_core.append(entry)
    if not up:
        raise EngineDeadError("no core answered: " + "; ".join(f"{c['endpoint']}: {c['error']}" for c in per_core))
    total: dict = {}
    for s in up:
        for k, v in s.items():
            if isinstance(v, int) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    if total.get("total_kv_blocks"):
        total["kv_usage"] = total.get("used_kv_blocks", 0) / total["total_kv_blocks"]
    if "prefix_queries" in total:
        total["prefix_hit_rate"] = total["prefix_hits"] / total["prefix_queries"] if total["prefix_queries"] else 0.0
    total.update(num_cores=len(endpoints), num_cores_up=len(up), cores=per_core)
    return total
