"""The client's request ids against a scripted core: a core whose every output the test decides, so the
moments that matter (a stop string matched before the core's final abort output) happen every run."""
from __future__ import annotations

import asyncio
import gc
import os
import threading

import pytest

from helpers.scripted_core import WAIT_S, ScriptedCore
from llmserve_client import AsyncClient, Client, RequestError
from llmserve_proto import Abort, Generate, RequestOutput
from llmserve_proto.messages import RequestError as RequestErrorMsg

@pytest.fixture
def scripted(tiny_model_dir, tmp_path):
    core = ScriptedCore(f"ipc://{tmp_path}/core.sock", tiny_model_dir)
    yield core
    core.close()


@pytest.fixture(scope="module")
def text_ids(tiny_model_dir):
    """Token ids whose text holds the stop string STOP, with text after it."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("one two three four five six")
    text = tok.decode(ids)
    assert "three" in text, text
    return ids


STOP = "three"


def test_an_id_is_free_again_once_its_stop_string_ended_it_and_late_outputs_stay_with_the_old(scripted, text_ids):
    with Client(scripted.endpoint, connect_timeout=WAIT_S) as c:
        first = c.stream([1, 2, 3], request_id="x", stop=[STOP])
        g1 = scripted.expect(Generate)
        scripted.send(RequestOutput(request_id=g1.request_id, token_ids=text_ids))
        assert [ch.finish_reason for ch in first][-1] == "stop"
        assert scripted.expect(Abort).request_ids == [g1.request_id]
        # The core has not sent the old request's final output yet: the caller has seen it end all the same.
        second = c.stream([1, 2, 3], request_id="x", max_tokens=4)
        g2 = scripted.expect(Generate)
        assert g2.request_id != g1.request_id
        scripted.send(RequestOutput(request_id=g1.request_id, token_ids=[7, 8], finish_reason="abort"),
                      RequestOutput(request_id=g2.request_id, token_ids=[9]))
        scripted.send(RequestOutput(request_id=g2.request_id, token_ids=[10], finish_reason="length"))
        chunks = list(second)
        assert [t for ch in chunks for t in ch.token_ids] == [9, 10]
        assert {ch.request_id for ch in chunks} == {"x"} and second.completion.finish_reason == "length"
        # Nothing of the new request reached the old, which kept its tokens up to the one completing STOP.
        kept = first.completion.token_ids
        assert 0 < len(kept) < len(text_ids) and kept == text_ids[:len(kept)]


def test_a_closed_stream_frees_its_id_and_abort_and_errors_speak_the_callers_id(scripted):
    with Client(scripted.endpoint, connect_timeout=WAIT_S) as c:
        with c.stream([1, 2, 3], request_id="y", max_tokens=100):
            g1 = scripted.expect(Generate)
        assert scripted.expect(Abort).request_ids == [g1.request_id]
        again = c.stream([1, 2, 3], request_id="y", max_tokens=100)
        g2 = scripted.expect(Generate)
        with pytest.raises(RequestError) as e:          # a live id is still refused, by the client itself
            c.stream([1, 2, 3], request_id="y")
        assert e.value.field == "request_id"
        c.abort("y")
        assert scripted.expect(Abort).request_ids == [g2.request_id]
        scripted.outgoing.put(RequestErrorMsg(request_id=g2.request_id, field="temperature", message="too hot"))
        with pytest.raises(RequestError) as e:
            list(again)
        assert (e.value.request_id, e.value.field) == ("y", "temperature")


def test_the_async_client_reuses_an_id_once_its_stop_string_ended_it(scripted, text_ids):
    async def main():
        async with AsyncClient(scripted.endpoint, connect_timeout=WAIT_S) as c:
            first = await c.stream([1, 2, 3], request_id="x", stop=[STOP])
            g1 = scripted.expect(Generate)
            scripted.send(RequestOutput(request_id=g1.request_id, token_ids=text_ids))
            assert [ch.finish_reason async for ch in first][-1] == "stop"
            assert scripted.expect(Abort).request_ids == [g1.request_id]
            second = await c.stream([1, 2, 3], request_id="x", max_tokens=4)
            g2 = scripted.expect(Generate)
            scripted.send(RequestOutput(request_id=g1.request_id, token_ids=[7], finish_reason="abort"),
                          RequestOutput(request_id=g2.request_id, token_ids=[9], finish_reason="length"))
            assert [t async for ch in second for t in ch.token_ids] == [9]

    asyncio.run(asyncio.wait_for(main(), WAIT_S))


@pytest.mark.parametrize("request_id", ["z" * 257, 5])
def test_a_request_id_no_message_can_carry_is_refused_by_name(scripted, request_id):
    with Client(scripted.endpoint, connect_timeout=WAIT_S) as c:
        with pytest.raises(RequestError) as e:
            c.stream([1, 2, 3], request_id=request_id)
        assert e.value.field == "request_id"


def abandon_a_live_stream(c, scripted):
    """Start a stream and drop it in a reference cycle (only the cyclic GC frees it); its Generate."""
    lost = c.stream([1, 2, 3], request_id="lost", max_tokens=100)
    g = scripted.expect(Generate)
    lost.cycle = lost
    return g


def opens_a_stream(c) -> bool:
    """Whether the client opens another stream within WAIT_S (on a thread: a deadlock must not hang the test)."""
    opened = []
    t = threading.Thread(target=lambda: opened.append(c.stream([1, 2, 3], request_id="next")), daemon=True)
    t.start()
    t.join(WAIT_S)
    return bool(opened)


def test_a_stream_the_cyclic_gc_collects_inside_the_clients_lock_does_not_deadlock(scripted, monkeypatch):
    """The cyclic GC runs wherever an allocation sets it off, inside the client's own critical sections too;
    a live stream it collects aborts its request, which needs that lock again."""
    from llmserve_client import cores
    with Client(scripted.endpoint, connect_timeout=WAIT_S) as c:
        gc.disable()     # the abandoned stream must be collected in the lock, not before
        try:
            g1 = abandon_a_live_stream(c, scripted)
            wire_id = cores.wire_request_id

            def collecting(*args):  # runs inside Cores.open's lock: the GC an allocation there sets off
                gc.collect()
                return wire_id(*args)

            monkeypatch.setattr(cores, "wire_request_id", collecting)
            opened = opens_a_stream(c)
        finally:
            gc.enable()
        assert opened, "the client deadlocked on its own lock"
        assert scripted.expect(Abort).request_ids == [g1.request_id]


def test_a_stream_the_cyclic_gc_collects_inside_the_transports_lock_does_not_deadlock(scripted):
    """As above, inside the transport's lock: the collected stream's abort is a send on that transport."""
    class CollectingRoutes(dict):
        def __contains__(self, key):    # read under the lock by register: the GC an allocation there sets off
            gc.collect()
            return super().__contains__(key)

    with Client(scripted.endpoint, connect_timeout=WAIT_S) as c:
        gc.disable()
        try:
            g1 = abandon_a_live_stream(c, scripted)
            transport = c._cores.transports[0]
            transport._routes = CollectingRoutes(transport._routes)
            opened = opens_a_stream(c)
        finally:
            gc.enable()
        assert opened, "the client deadlocked on its transport's lock"
        assert scripted.expect(Abort).request_ids == [g1.request_id]


def test_a_stream_the_cyclic_gc_collects_inside_the_wakeup_lock_does_not_deadlock(scripted, monkeypatch):
    """As above, inside the lock that guards the transport's wakeup pipe: a full pipe's BlockingIOError is an
    allocation there, and the collected stream's abort wakes the transport again."""
    c = Client(scripted.endpoint, connect_timeout=WAIT_S)
    transport = c._cores.transports[0]
    write = os.write

    def full_pipe(fd, data):
        if fd != transport._wake_w:
            return write(fd, data)
        monkeypatch.setattr(os, "write", write)     # once: later wakeups reach the pipe
        gc.collect()
        raise BlockingIOError

    gc.disable()
    try:
        g1 = abandon_a_live_stream(c, scripted)
        monkeypatch.setattr(os, "write", full_pipe)
        opened = opens_a_stream(c)
    finally:
        gc.enable()
    # Not closed on failure: closing takes the same lock, which a deadlocked client holds for good.
    assert opened, "the client deadlocked on its wakeup lock"
    assert scripted.expect(Generate).request_id.startswith("next")    # queued before its wakeup collected
    assert scripted.expect(Abort).request_ids == [g1.request_id]
    c.close()
