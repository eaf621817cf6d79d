"""Units of the daemon's defences: log escaping and rate limits, the unread-output bound, the waiting
queue's round-robin order, and the busy loop's request bookkeeping (end to end in test_hostile_clients.py)."""
from __future__ import annotations

import os
import queue
import threading
import time
import types

import pytest
import zmq

from llmserve_core.engine.request import Request
from llmserve_core.engine.waiting_queue import WaitingQueue
from llmserve_core.server.busy_loop import BusyLoop
from llmserve_core.server.events import AbortRequests, ClientGone, ErrorReply, NewRequest, StatsQuery, StepResult
from llmserve_core.server.log_safety import LogLimiter, printable
from llmserve_core.server.outbox import Outbox
from llmserve_core.server import socket_thread
from llmserve_core.server.socket_thread import STATS_BURST, SocketThread
from llmserve_proto import Generate, GuidedDecoding, Hello, ModelInfo, SamplingParams, StatsRequest, Welcome, decode_core, encode

from helpers.daemon import recv_reply


@pytest.mark.parametrize("raw, logged", [
    ("plain name", "plain name"),
    ("a\nb\r\tc", "a\\x0ab\\x0d\\x09c"),
    ("\x1b[31mred\x7f", "\\x1b[31mred\\x7f"),
    ("rtl\u202eevil\u2028x", "rtl\\u202eevil\\u2028x"),
    ("back\\slash", "back\\\\slash"),
    ("naïve 中文", "naïve 中文"),
])
def test_printable_escapes_what_could_forge_a_line(raw, logged):
    assert printable(raw) == logged


def test_printable_truncates_and_says_how_much():
    out = printable("x" * 10_000_000, limit=50)
    assert out == "x" * 50 + "...(+9999950 chars)"
    assert printable(12345) == "12345"


def test_log_limiter_allows_a_burst_per_key_then_reports_what_it_held_back():
    now = [0.0]
    lim = LogLimiter(burst=3, window=10.0, clock=lambda: now[0])
    assert [lim.allow("a")[0] for _ in range(5)] == [True, True, True, False, False]
    assert lim.allow("b") == (True, 0)              # other clients have their own budget
    now[0] = 10.5
    assert lim.allow("a") == (True, 2)              # the two held back are reported with the next line


def test_log_limiter_table_stays_small():
    now = [0.0]
    lim = LogLimiter(burst=1, window=1.0, max_keys=100, clock=lambda: now[0])
    for i in range(1000):
        now[0] = i * 0.001
        lim.allow(i)
    assert len(lim._state) <= 100


class FakePeer:
    def __init__(self, capacity: int):
        self.capacity, self.got = capacity, []

    def __call__(self, client, payload) -> bool:
        if len(self.got) >= self.capacity:
            return False
        self.got.append(payload)
        return True


def test_outbox_keeps_order_behind_a_full_peer_and_drains_when_it_reads():
    ob, peer = Outbox(max_bytes=100, max_stall_s=5.0), FakePeer(capacity=2)
    for i in range(5):
        assert ob.send(b"c", b"m%d" % i, peer, now=0.0) is None
    assert peer.got == [b"m0", b"m1"] and ob.queued_bytes() == 6
    peer.capacity = 10                               # the client read its socket
    assert ob.flush(peer, now=1.0) == []
    assert peer.got == [b"m0", b"m1", b"m2", b"m3", b"m4"] and not ob.backlogs


def test_outbox_disconnects_past_its_byte_cap_or_its_stall_time():
    ob, peer = Outbox(max_bytes=10, max_stall_s=5.0), FakePeer(capacity=0)
    assert ob.send(b"c", b"12345", peer, now=0.0) is None
    assert ob.send(b"c", b"123456", peer, now=0.0) is not None       # 11 bytes > 10
    ob2 = Outbox(max_bytes=10**6, max_stall_s=5.0)
    ob2.send(b"d", b"x", peer, now=0.0)
    assert ob2.flush(peer, now=4.0) == []
    (client, reason), = ob2.flush(peer, now=6.0)
    assert client == b"d" and "unread" in reason


def test_outbox_flush_survives_a_peer_found_gone_while_draining():
    # The socket thread's try_send forgets a client whose peer has gone (EHOSTUNREACH); the flush that
    # was draining that client's backlog must carry on, not trip over the missing entry.
    ob, peer = Outbox(max_bytes=100, max_stall_s=5.0), FakePeer(capacity=0)
    ob.send(b"gone", b"m0", peer, now=0.0)
    ob.send(b"gone", b"m1", peer, now=0.0)
    ob.send(b"slow", b"s0", peer, now=0.0)

    tried_gone = []

    def try_send(client, payload):
        if client == b"gone":
            tried_gone.append(payload)
            ob.forget(client)
            return True
        return peer(client, payload)
    (client, reason), = ob.flush(try_send, now=6.0)
    assert client == b"slow" and "unread" in reason and list(ob.backlogs) == [b"slow"]
    assert tried_gone == [b"m0"]                     # nothing more is sent to a peer known gone


def _req(rid, client):
    return Request(rid, [1, 2], SamplingParams(), frozenset(), 64, client=client)


def test_waiting_queue_round_robin_across_clients_fifo_within_one():
    q = WaitingQueue()
    for i in range(4):
        q.append(_req(f"a{i}", "A"))
    q.append(_req("b0", "B"))
    q.append(_req("c0", "C"))
    q.append(_req("b1", "B"))
    order = []
    while q:
        order.append(q.peek().request_id)
        assert q.pop().request_id == order[-1]
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]



def test_waiting_queue_passes_over_skipped_requests_in_round_robin_order():
    # a0 may not start yet (its grammar compiles): the others go in the order they would have anyway,
    # and a0 keeps its place at the head of client A.
    q = WaitingQueue()
    for rid, client in (("a0", "A"), ("a1", "A"), ("b0", "B"), ("b1", "B"), ("c0", "C")):
        q.append(_req(rid, client))
    taken = []
    while (r := q.peek({"a0"})) is not None:
        taken.append(q.pop(r).request_id)
    assert taken == ["b0", "c0", "b1", "a1"]
    assert len(q) == 1 and q.peek().request_id == "a0" and q.pop().request_id == "a0" and not q

def test_waiting_queue_preempted_go_first_in_their_own_clients_queue_counts_and_removal():
    q = WaitingQueue()
    a0, a1, b0, p = _req("a0", "A"), _req("a1", "A"), _req("b0", "B"), _req("p", "B")
    q.append(p)
    assert q.pop() is p and q.running("B") == 1 and q.count("B") == 0
    for r in (a0, a1, b0):
        q.append(r)
    q.push_preempted(p)           # p gives its slot back and goes ahead of b0, not of client A
    assert q.running("B") == 0 and q.count("A") == 2 and q.count("B") == 1 and len(q) == 4
    assert q.remove(a0) and not q.remove(a0) and len(q) == 3
    assert [q.pop().request_id for _ in range(3)] == ["a1", "p", "b0"]
    assert q.running("A") == 1 and q.running("B") == 2 and q.num_tokens() == 0


def test_waiting_queue_admits_the_client_running_the_fewest_and_forgets_idle_clients():
    q = WaitingQueue()
    flood = [_req(f"f{i}", "F") for i in range(5)]
    for r in flood:
        q.append(r)
    for _ in range(4):
        q.pop()
    q.append(_req("s0", "S"))
    q.append(_req("s1", "S"))
    # F runs 4, S none: S goes first until it runs as many; then turns alternate.
    assert [q.pop().request_id for _ in range(3)] == ["s0", "s1", "f4"]
    assert q.most_running() == ("F", 5) and q.num_clients == 2
    for r in flood:
        q.stopped(r)
    assert q.num_clients == 1 and q.running("F") == 0
    q.stopped(_req("s0", "S"))
    q.stopped(_req("s1", "S"))
    assert q.num_clients == 0 and q.most_running() == (None, 0)     # nothing is kept for idle clients


# ---- the busy loop's request bookkeeping, against a real tiny engine ----------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from llmserve_core import Engine, EngineConfig
    return Engine(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=512, num_kv_blocks=64))


def _run_events(engine, events) -> tuple[BusyLoop, list]:
    """Hand `events` to a busy loop at once (as one turn of its input queue), step the engine until it is
    idle, and return the loop and everything it queued for the output thread."""
    in_q, out_q = queue.SimpleQueue(), queue.SimpleQueue()
    for e in events:
        in_q.put(e)
    busy = BusyLoop(engine, in_q, out_q, log_interval=0)
    busy._drain_inputs(block=False)
    while engine.has_unfinished():
        busy._step()
    out = []
    while not out_q.empty():
        out.append(out_q.get())
    return busy, out


def _finals(out) -> list[tuple[bytes, str, str]]:
    """(client, request id, finish reason) of each final item the busy loop sent."""
    finals = []
    for item in out:
        if isinstance(item, StepResult):
            finals += [(c, rid, so.finish_reason) for c, rid, so, _ in item.items if so.finish_reason]
        elif isinstance(item, ErrorReply):
            finals.append((item.client, item.request_id, "error"))
    return finals


def _generate(client: bytes, rid: str, max_tokens: int) -> NewRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return NewRequest(client, Generate(request_id=rid, prompt_token_ids=[1, 2, 3], params=params), 0.0)


def test_a_request_id_reused_after_the_session_ended_is_not_ended_by_the_old_ones_abort(tiny_engine):
    # A client that says goodbye and hello again on the same socket (one identity) and reuses an id: the
    # first request's abort must not end the second, nor leave the second running with nobody to stop it.
    busy, out = _run_events(tiny_engine, [_generate(b"A", "r", 400), ClientGone(b"A", "said goodbye"),
                                          _generate(b"A", "r", 3)])
    assert _finals(out) == [(b"A", "r", "length")]
    assert not busy.live and not tiny_engine.requests
    tiny_engine.block_manager.check_invariants()


def test_repeated_and_unknown_aborts_count_each_aborted_request_once(tiny_engine):
    busy, out = _run_events(tiny_engine, [_generate(b"A", "r", 400), AbortRequests(b"A", ["r", "r", "nope"]),
                                          AbortRequests(b"A", ["r"]), AbortRequests(b"B", ["r"])])
    assert _finals(out) == [(b"A", "r", "abort")]
    assert busy.counters["requests_aborted_by_client"] == 1


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) one thread of this process has used, from /proc."""
    stat = open(f"/proc/self/task/{native_id}/stat").read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_loop_sleeps_while_its_only_request_waits_for_its_grammar(tiny_engine, monkeypatch):
    """A grammar still compiling (held here) leaves the loop with nothing to step: it sleeps, using no CPU
    and taking no steps, rather than spinning (which starved the compiler of the GIL); a plain request that
    comes meanwhile is served at once; the compilation's end wakes the loop and the guided request runs."""
    from llmserve_core.engine.grammar import GrammarService
    gate = threading.Event()
    real = GrammarService._compile
    monkeypatch.setattr(GrammarService, "_compile", lambda self, g: (gate.wait(120), real(self, g))[1])
    steps = [0]
    real_step = tiny_engine.step

    def counted_step():
        steps[0] += 1
        return real_step()

    monkeypatch.setattr(tiny_engine, "step", counted_step)
    in_q, out_q = queue.SimpleQueue(), queue.SimpleQueue()
    busy = BusyLoop(tiny_engine, in_q, out_q, log_interval=0)
    native = []
    loop = threading.Thread(target=lambda: (native.append(threading.get_native_id()), busy.run()))
    loop.start()
    try:
        guided = SamplingParams(max_tokens=8, temperature=0.0, guided=GuidedDecoding(kind="choice", choices=["ok"]))
        in_q.put(NewRequest(b"A", Generate(request_id="g", prompt_token_ids=[1, 2, 3], params=guided), 0.0))
        deadline = time.monotonic() + 60
        while not any(k.endswith("/g") for k in tiny_engine.requests):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)                        # the loop's turn that found nothing to run has ended
        steps0, cpu0, t0 = steps[0], _thread_cpu_s(native[0]), time.monotonic()
        time.sleep(1.0)
        cpu = (_thread_cpu_s(native[0]) - cpu0) / (time.monotonic() - t0)
        assert steps[0] - steps0 <= 2 and cpu < 0.05, (steps[0] - steps0, cpu)
        in_q.put(_generate(b"B", "p", 3))      # served while the grammar still compiles
        finals = []
        while (b"B", "p", "length") not in finals:
            finals += _finals([out_q.get(timeout=60)])
        assert not gate.is_set() and (b"A", "g", "stop") not in finals
        gate.set()
        while (b"A", "g", "stop") not in finals:
            finals += _finals([out_q.get(timeout=60)])
    finally:
        gate.set()
        busy.stop_reason = "test over"
        loop.join(60)
    assert not loop.is_alive()


def test_saying_hello_again_does_not_refill_the_stats_rate(tmp_path):
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(f"ipc://{tmp_path}/core.sock")
    dealer.connect(f"ipc://{tmp_path}/core.sock")
    dealer.send(encode(Hello()))
    client = router.recv_multipart()[0]
    in_q = queue.SimpleQueue()
    welcome = Welcome(protocol_version=1, model_info=ModelInfo(model="m"), heartbeat_interval_s=1.0,
                      client_timeout_s=10.0)
    st = SocketThread(ctx, router, f"inproc://pair-{tmp_path.name}", in_q, welcome, 1.0, 10.0)
    try:
        now = 1000.0        # one instant: nothing refills the rate meanwhile
        st._handle(client, Hello(), now)
        for i in range(STATS_BURST + 1):
            st._handle(client, StatsRequest(nonce=i), now)
        st._handle(client, Hello(), now)
        st._handle(client, StatsRequest(nonce=-1), now)
        answered = []
        while not in_q.empty():
            item = in_q.get()
            if isinstance(item, StatsQuery):
                answered.append(item.nonce)
        assert answered == list(range(STATS_BURST))
    finally:
        st.pair.close(linger=0)
        router.close(linger=0)
        dealer.close(linger=0)



def test_time_the_core_itself_was_stalled_is_not_its_clients_silence(tmp_path, monkeypatch):
    # The socket thread is kept from its loop (the process stopped, the machine or the GIL starved it) for
    # longer than the client timeout. Its clients kept talking into buffers it did not read, and could not
    # read what it did not send: the first turn after the stall must drop neither the idle client nor the
    # one with output waiting for it in the core.
    offset = [0.0]
    monkeypatch.setattr(socket_thread, "time", types.SimpleNamespace(monotonic=lambda: time.monotonic() + offset[0]))
    ctx, timeout = zmq.Context.instance(), 60.0
    router = socket_thread.bind_router(ctx, f"ipc://{tmp_path}/core.sock")
    idle, busy = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    busy.setsockopt(zmq.RCVHWM, 1)
    busy.setsockopt(zmq.RCVBUF, 4096)
    in_q, pair_addr = queue.SimpleQueue(), f"inproc://pair-{tmp_path.name}"
    welcome = Welcome(protocol_version=1, model_info=ModelInfo(model="m"), heartbeat_interval_s=0.05,
                      client_timeout_s=timeout)
    st = SocketThread(ctx, router, pair_addr, in_q, welcome, 0.05, timeout)
    outputs = ctx.socket(zmq.PAIR)          # stands in for the output thread
    outputs.connect(pair_addr)
    st.start()
    try:
        ids = []
        for s in (idle, busy):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 60_000)
            s.connect(f"ipc://{tmp_path}/core.sock")
            s.send(encode(Hello()))
            assert isinstance(recv_reply(s), Welcome)
            ids += [c for c in list(st.clients) if c not in ids]
        busy_id = ids[1]
        while busy_id not in st.outbox.backlogs:        # output it has not read waits in the core
            outputs.send_multipart([busy_id, b"x" * 1000])
            time.sleep(0.001)
        offset[0] = 2 * timeout                         # the stall, as the thread's clock sees it
        stalled = time.monotonic() + offset[0]
        while decode_core(idle.recv()).time < stalled:
            pass                                        # a turn after the stall has run its checks
        idle.send(encode(StatsRequest(nonce=7)))
        while not isinstance(item := in_q.get(timeout=60), StatsQuery):
            assert not isinstance(item, ClientGone), item
        assert item.nonce == 7 and len(st.clients) == 2
    finally:
        outputs.send_multipart([b"", b""])              # the end marker: the thread stops
        st.join(10)
        outputs.close(linger=0)
        router.close(linger=0)
        idle.close()
        busy.close()
