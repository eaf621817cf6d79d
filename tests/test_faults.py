"""Fault injection against the daemon: an engine step that raises, a KV pool one request fills, and a core
that is stopped (SIGSTOP) and resumed: its clients see it dead, or, stopped for less than their heartbeat
timeout, lose nothing."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from llmserve_client import Client, EngineDeadError, RequestError

from helpers.daemon import READY_TIMEOUT, start_core, stop_core, wait_idle, wait_ready

POISON = [13, 13, 13, 13, 13]     # a prompt the test's patched model runner fails on


@pytest.fixture
def faulty_daemon(tiny_model_dir, tmp_path):
    """A daemon serving in this process, whose model runner raises for any batch holding POISON: only this
    test's patch, never product code, knows about the poison."""
    from llmserve_core import Engine, EngineConfig
    from llmserve_core.server import DaemonConfig, serve
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=512, num_kv_blocks=64,
                              max_num_seqs=2))
    real_launch = eng.runner.launch_forward

    def launch(sched):
        if any(r.prompt_token_ids == POISON for r in sched.requests):
            raise RuntimeError("injected kernel fault")
        return real_launch(sched)

    eng.runner.launch_forward = launch
    endpoint = f"ipc://{tmp_path}/core.sock"
    daemon = DaemonConfig(heartbeat_interval=0.2, client_timeout=30.0, log_interval=0)
    codes, stop = [], threading.Event()
    t = threading.Thread(target=lambda: codes.append(serve(eng, daemon, endpoint, stop=stop)), daemon=True)
    t.start()
    yield endpoint, eng
    stop.set()
    t.join(60)
    assert codes == [0], codes


def test_a_failing_step_fails_only_its_requests_and_the_core_serves_on(faulty_daemon):
    endpoint, eng = faulty_daemon
    with Client(endpoint, connect_timeout=READY_TIMEOUT, client_name="a") as a, \
            Client(endpoint, client_name="b") as b:
        long = a.stream([1, 2, 3], max_tokens=300, ignore_eos=True, temperature=0.0)
        next(long)                                           # running: it is in every step from now on
        poison = b.stream(POISON, max_tokens=5, ignore_eos=True)
        # max_num_seqs=2: with `long` and the poisoned request running, this one waits outside the step.
        waiting = b.stream([7, 8, 9], max_tokens=6, ignore_eos=True, temperature=0.0)
        with pytest.raises(RequestError, match="injected kernel fault") as e:
            for _ in poison:
                pass
        assert e.value.field == "" and "internal error" in e.value.message
        with pytest.raises(RequestError, match="injected kernel fault"):
            for _ in long:
                pass
        for _ in waiting:
            pass
        assert waiting.completion.finish_reason == "length" and len(waiting.completion.token_ids) == 6
        again = a.generate([1, 2, 3], max_tokens=4, ignore_eos=True, temperature=0.0)
        assert len(again.token_ids) == 4
        s = wait_idle(a)
        assert s["requests_failed"] == 2
    eng.block_manager.check_invariants()


@pytest.fixture(scope="module")
def small_pool_core(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("small-pool")
    endpoint, log = f"ipc://{d}/core.sock", str(d / "core.log")
    proc = start_core(tiny_model_dir, endpoint, log, "--num-kv-blocks", "16")     # 256 tokens of KV
    try:
        wait_ready(endpoint, proc, log)
        yield endpoint, proc
    finally:
        assert stop_core(proc) == 0, open(log).read()[-3000:]


def test_a_request_bigger_than_the_kv_pool_gets_a_clear_error(small_pool_core):
    endpoint, proc = small_pool_core
    with Client(endpoint) as c:
        with pytest.raises(RequestError) as e:
            c.generate([1] * 10, max_tokens=400, ignore_eos=True)
        assert e.value.field == "max_tokens" and "KV blocks" in e.value.message
        assert len(c.generate([1, 2, 3], max_tokens=3).token_ids) == 3
    assert proc.poll() is None


def test_one_request_filling_the_pool_leaves_others_served(small_pool_core):
    endpoint, _ = small_pool_core
    with Client(endpoint, client_name="huge") as big, Client(endpoint, client_name="small") as small:
        huge = big.stream(list(range(1, 101)), max_tokens=150, ignore_eos=True)   # 250 tokens: all 16 blocks
        next(huge)
        done = [small.generate([5, 6, 7], max_tokens=4, ignore_eos=True) for _ in range(3)]
        assert all(len(d.token_ids) == 4 for d in done)
        for _ in huge:
            pass
        assert huge.completion.finish_reason == "length" and len(huge.completion.token_ids) == 150
        wait_idle(small)


def test_sigstopped_core_is_declared_dead_and_serves_again_after_sigcont(tiny_model_dir, tmp_path):
    endpoint, log = f"ipc://{tmp_path}/core.sock", str(tmp_path / "core.log")
    # A long stream, so that it is surely still running when the stop lands on a busy machine.
    proc = start_core(tiny_model_dir, endpoint, log, "--max-model-len", "2048")
    try:
        wait_ready(endpoint, proc, log)
        c = Client(endpoint, heartbeat_timeout=2.0)
        s = c.stream([1, 2, 3], max_tokens=2000, ignore_eos=True)
        next(s)
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            for _ in s:
                pass
        # The bound is the heartbeat timeout (2 s) plus the transport's poll; slack for a busy machine.
        assert time.monotonic() - t0 < 2.0 + 8.0
        with pytest.raises(EngineDeadError):
            c.generate([1], max_tokens=2)
        c.close()
        proc.send_signal(signal.SIGCONT)
        with Client(endpoint, connect_timeout=READY_TIMEOUT) as fresh:
            assert len(fresh.generate([4, 5, 6], max_tokens=3).token_ids) == 3
            s = wait_idle(fresh)       # the stopped client's request was aborted, its blocks freed
            assert s["requests_aborted_disconnect"] >= 1
    finally:
        proc.send_signal(signal.SIGCONT)
        assert stop_core(proc) == 0, open(log).read()[-3000:]


def test_a_client_waiting_through_a_core_stall_past_the_client_timeout_keeps_its_request(tiny_model_dir, tmp_path):
    # The core is stopped for longer than its client timeout (3 s here) while a client waits on a long
    # stream, pinging all along into the core's socket. Waking, the core must not take the pings it has not
    # read yet for silence and abort the stream.
    endpoint, log = f"ipc://{tmp_path}/core.sock", str(tmp_path / "core.log")
    proc = start_core(tiny_model_dir, endpoint, log, "--max-model-len", "2048")
    try:
        wait_ready(endpoint, proc, log)
        with Client(endpoint, client_name="patient", heartbeat_timeout=120.0) as c:
            s = c.stream([1, 2, 3], max_tokens=2000, ignore_eos=True)
            next(s)
            proc.send_signal(signal.SIGSTOP)
            time.sleep(4.0)         # the stall itself
            proc.send_signal(signal.SIGCONT)
            for _ in range(100):    # far more steps than ran before the stop landed: the request lives on
                next(s)
            assert c.stats()["requests_aborted_disconnect"] == 0
            s.close()
        assert "(patient) gone: silent" not in open(log).read()
    finally:
        proc.send_signal(signal.SIGCONT)
        assert stop_core(proc) == 0, open(log).read()[-3000:]

def test_a_failing_output_thread_ends_the_core_instead_of_leaving_it_deaf(tiny_model_dir, tmp_path):
    # The output thread hits a bug (here: a stats value no msgpack integer holds). The core must say so to
    # its clients and exit non-zero, not live on with nobody reading its socket or sending for it.
    from llmserve_core import Engine, EngineConfig
    from llmserve_core.server import DaemonConfig, serve
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=512, num_kv_blocks=64))
    real_stats = eng.stats
    eng.stats = lambda: {**real_stats(), "unencodable": 2**70}
    endpoint = f"ipc://{tmp_path}/core.sock"
    codes, stop = [], threading.Event()
    t = threading.Thread(target=lambda: codes.append(serve(eng, DaemonConfig(heartbeat_interval=0.2, log_interval=0),
                                                           endpoint, stop=stop)), daemon=True)
    t.start()
    try:
        with Client(endpoint, connect_timeout=READY_TIMEOUT, reconnect=False) as c:
            with pytest.raises(EngineDeadError, match="output thread failed"):
                c.stats()
        t.join(60)
        assert codes == [1]
    finally:
        stop.set()
        t.join(60)
