"""Scheduler policy without a model: decode-first budgets, chunking, admission and preemption."""
import random

from llmserve_core.engine.block_manager import BlockManager
from llmserve_core.engine.request import Request, RequestStatus
from llmserve_core.engine.scheduler import Scheduler
from llmserve_core.engine.waiting_queue import WaitingQueue
from llmserve_proto import SamplingParams

from helpers.scheduler import advance


def req(rid, n_prompt, max_tokens=100):
    # Distinct token content per request, so the prefix cache never shortcuts a prefill here.
    base = 1000 * (sum(map(ord, rid)) % 1000)
    return Request(rid, list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens), frozenset(), 10_000)


def test_decode_first_then_chunked_prefill():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=True)
    a, b = req("a", 3), req("b", 25)
    s.add(a)
    advance(s, s.schedule())             # a prefills (3 tokens)
    s.add(b)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"]
    assert batch.num_new_tokens == [1, 9]  # a's decode first, b gets the rest of the budget
    advance(s, batch)
    batch = s.schedule()
    assert batch.num_new_tokens == [1, 9]
    advance(s, batch)
    batch = s.schedule()
    assert batch.num_new_tokens == [1, 7]  # b's last chunk
    advance(s, batch)
    assert b.num_output_tokens == 1


def test_without_chunking_a_prompt_waits_for_whole_budget():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = req("a", 3), req("b", 9)
    s.add(a)
    advance(s, s.schedule())
    s.add(b)
    batch = s.schedule()
    assert batch.num_new_tokens == [1, 9]
    c = req("c", 10)
    s.add(c)
    advance(s, batch)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"]   # c (10) does not fit beside 2 decodes
    advance(s, batch)


def test_max_num_seqs_caps_running():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100, enable_chunked_prefill=True)
    for i in range(4):
        s.add(req(f"r{i}", 2))
    batch = s.schedule()
    assert len(batch) == 2 and len(s.waiting) == 2


def test_preempts_newest_and_recomputes_without_loss():
    bm = BlockManager(6, 2)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    advance(s, s.schedule())                      # 4 of 6 blocks used
    for _ in range(5):                            # a grows to 10 tokens (5 blocks), never preempted itself
        batch = s.schedule()
        for r in batch.preempted:
            assert r is b and r.status == RequestStatus.WAITING and r.block_ids == []
        advance(s, batch)
        bm.check_invariants()
    assert s.num_preemptions >= 1
    assert a.num_output_tokens > b.num_output_tokens  # the older request kept going


def test_random_load_always_progresses():
    rnd = random.Random(0)
    bm = BlockManager(12, 2)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=True)
    reqs = [req(f"r{i}", rnd.randrange(1, 8), max_tokens=rnd.randrange(1, 6)) for i in range(20)]
    for r in reqs:
        s.add(r)
    for _ in range(1000):
        if not s.has_unfinished():
            break
        batch = s.schedule()
        assert batch.requests, "scheduler stalled with work left"
        assert batch.total_tokens <= 8 and len(s.running) <= 4
        advance(s, batch)
        for r in list(s.running):
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r)
        bm.check_invariants()
    assert not s.has_unfinished()
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert bm.num_used_blocks == 0


class _Compiling:
    """A grammar still compiling: its request may not start yet."""
    ready = False


def test_requests_that_may_not_start_cost_one_look_per_step(monkeypatch):
    # One client queues thousands of guided requests whose grammars still compile; another's request
    # behind them must not make each step walk the queue once per request passed over (a step of
    # seconds for every client's decodes).
    looked = 0
    admission_order = WaitingQueue.admission_order

    def counting(self, skip):
        nonlocal looked
        for r in admission_order(self, skip):
            looked += 1
            yield r

    monkeypatch.setattr(WaitingQueue, "admission_order", counting)
    s = Scheduler(BlockManager(1000, 4), max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    n = 2000
    for i in range(n):
        r = req(f"g{i}", 5)
        r.client, r.grammar = "flood", _Compiling()
        s.add(r)
    good = req("good", 5)
    good.client = "good"
    s.add(good)
    for _ in range(3):
        looked = 0
        batch = s.schedule()
        assert looked <= 2 * (n + 1)
        advance(s, batch)
    assert good.num_output_tokens == 3 and good.num_computed_tokens == 7
    assert s.blocks.num_used_blocks == len(good.block_ids)      # the passed-over hold no blocks
