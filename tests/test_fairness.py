"""Fair shares between clients: the scheduler alone (no model), then the in-process Engine on the tiny model.

A client that floods the engine with requests (and reads its answers) may hold at most its max-min fair share
of the running slots and of a step's prefill budget while another client waits; a lone client still gets
everything; preemption for fairness loses no token.
"""
import random

import pytest
import torch

from llmserve_core import Engine, EngineConfig
from llmserve_core.engine.block_manager import BlockManager
from llmserve_core.engine.request import Request
from llmserve_core.engine.scheduler import Scheduler, fair_shares
from llmserve_proto import SamplingParams

from helpers.scheduler import advance

BOUND = 4          # fairness_preempt_steps in these tests


def req(rid, client, n_prompt=4, max_tokens=400):
    base = 1000 * (sum(map(ord, rid)) % 1000)      # distinct prompts: no prefix-cache shortcut
    return Request(rid, list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens), frozenset(),
                   100_000, client=client)


def step(s: Scheduler):
    batch = s.schedule()
    advance(s, batch)
    for r in list(s.running):
        if r.num_output_tokens >= r.params.max_tokens:
            s.finish(r)
    s.blocks.check_invariants()
    return batch


def running_of(s: Scheduler, client) -> int:
    return sum(r.client == client for r in s.running)


def test_fair_shares_is_max_min_fair():
    assert fair_shares({"a": 2, "b": 100}, 64) == {"a": 2, "b": 62}
    assert fair_shares({"a": 100, "b": 100, "c": 5}, 64) == {"c": 5, "a": 29, "b": 30}
    assert fair_shares({"a": 10}, 64) == {"a": 10}
    rnd = random.Random(0)
    for _ in range(500):
        demands = {k: rnd.randrange(0, 50) for k in range(rnd.randrange(1, 8))}
        cap = rnd.randrange(0, 200)
        got = fair_shares(demands, cap)
        assert all(0 <= got[k] <= demands[k] for k in demands)
        assert sum(got.values()) == min(cap, sum(demands.values()))
        unmet = [got[k] for k in demands if got[k] < demands[k]]
        if unmet:     # every unmet demand got an equal share (within 1), at least what any met one got
            assert max(unmet) - min(unmet) <= 1 and min(unmet) >= max(got.values()) - 1


def test_a_lone_client_fills_every_slot():
    s = Scheduler(BlockManager(1000, 4), max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                  fairness_preempt_steps=BOUND)
    for i in range(100):
        s.add(req(f"f{i}", "F"))
    for _ in range(3):
        step(s)
    assert len(s.running) == 8 and s.num_preemptions == 0


def _flooded(bound: int, max_num_seqs: int = 8) -> Scheduler:
    """Client F with 2,000 requests of 400 tokens queued holds every slot, all decoding."""
    s = Scheduler(BlockManager(4000, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                  enable_chunked_prefill=True, fairness_preempt_steps=bound)
    for i in range(2000):
        s.add(req(f"f{i}", "F"))
    for _ in range(3):
        step(s)
    assert len(s.running) == max_num_seqs and not any(r.is_prefilling for r in s.running)
    return s


def _steps_until_admitted(s: Scheduler, probe: Request, limit: int = 1000) -> int:
    for n in range(1, limit + 1):
        step(s)
        if probe.num_computed_tokens > 0 or probe.is_finished:
            return n
    return limit


@pytest.mark.parametrize("bound", [BOUND, 1])
def test_a_probe_beside_a_flood_holding_every_slot_starts_within_the_bound(bound):
    s = _flooded(bound)
    for k in range(3):
        probe = req(f"p{k}", "P", max_tokens=2)
        s.add(probe)
        waited = _steps_until_admitted(s, probe)
        assert waited <= bound + 1, waited
        assert running_of(s, "F") == 7 and s.num_fairness_preemptions == k + 1
        while not probe.is_finished:
            step(s)
        assert probe.num_output_tokens == 2
        step(s)
        assert running_of(s, "F") == 8          # the slot went back to the flood (its victim first)
    assert len(s.waiting) == 2000 - 8           # nothing lost: the victims wait at the front of F's queue


def test_without_fairness_preemption_a_probe_waits_for_a_flood_request_to_end():
    # What the bound buys: with slots freed only as requests end, the probe waits out a whole flood request.
    s = _flooded(0)
    probe = req("p", "P", max_tokens=2)
    s.add(probe)
    assert _steps_until_admitted(s, probe) > 300
    assert s.num_fairness_preemptions == 0


def test_two_floods_converge_to_equal_shares_and_a_third_client_gets_its_share():
    s = _flooded(BOUND)
    for i in range(1000):
        s.add(req(f"g{i}", "G"))
    for _ in range(10 * BOUND):
        step(s)
    assert running_of(s, "F") == running_of(s, "G") == 4
    s.add(req("h0", "H", max_tokens=1000))
    s.add(req("h1", "H", max_tokens=1000))
    s.add(req("h2", "H", max_tokens=1000))
    for _ in range(10 * BOUND):
        step(s)
    counts = sorted(running_of(s, c) for c in "FGH")
    assert counts == [2, 3, 3], counts                  # 8 slots over three clients wanting more than 8/3
    preempted = s.num_fairness_preemptions
    for _ in range(10 * BOUND):
        step(s)
    assert s.num_fairness_preemptions == preempted      # at max-min fair, nobody is preempted any more


def test_a_long_prompt_prefilling_leaves_another_clients_prompt_room_in_the_step():
    s = Scheduler(BlockManager(4000, 4), max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                  fairness_preempt_steps=BOUND)
    big = req("big", "A", n_prompt=5000)
    s.add(big)
    step(s)
    assert big.num_computed_tokens == 64
    small = req("small", "B", n_prompt=10, max_tokens=2)
    s.add(small)
    batch = step(s)
    assert small in batch.requests and batch.num_new_tokens[batch.requests.index(small)] == 10
    assert batch.num_new_tokens[batch.requests.index(big)] == 54      # what the small prompt left
    step(s)
    assert small.num_output_tokens == 2 or small.is_finished


def test_fairness_preemption_under_random_load_loses_nothing():
    rnd = random.Random(1)
    bm = BlockManager(40, 2)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=True, fairness_preempt_steps=2)
    reqs = [req(f"r{i}", rnd.choice("ABC"), n_prompt=rnd.randrange(1, 8), max_tokens=rnd.randrange(1, 12))
            for i in range(60)]
    pending = list(reqs)
    for _ in range(3000):
        if pending and rnd.random() < 0.3:
            s.add(pending.pop(0))
        if not s.has_unfinished() and not pending:
            break
        batch = step(s)
        assert batch.total_tokens <= 8 and len(batch) <= 4
    assert not s.has_unfinished() and not pending
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert bm.num_used_blocks == 0 and s.num_fairness_preemptions > 0 and s.waiting.num_clients == 0


# ---- the in-process engine, tiny model, two client ids --------------------------------------------------

FLOOD_TOKENS = 48


def _flood_engine(tiny_model_dir, **kw) -> Engine:
    cfg = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
               fairness_preempt_steps=BOUND)
    return Engine(EngineConfig(model=str(tiny_model_dir), **{**cfg, **kw}))


def _prompt(i: int) -> list[int]:
    return [3 + (i * 7 + j) % 200 for j in range(5 + i % 3)]


def _run(engine: Engine, probe_after: int | None, n_flood: int = 12):
    """The flood client's requests, then (after `probe_after` steps) one 2-token request of another client.
    Returns (each flood request's tokens, the probe's steps to its first token)."""
    greedy = SamplingParams(max_tokens=FLOOD_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(n_flood):
        engine.add_request(f"f{i}", _prompt(i), greedy, client="flood")
    tokens = {f"f{i}": [] for i in range(n_flood)}
    probe_tokens, waited, steps = [], None, 0
    while engine.has_unfinished():
        if steps == probe_after:
            engine.add_request("probe", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                               client="probe")
        steps += 1
        for out in engine.step():
            if out.request_id == "probe":
                if not probe_tokens and out.new_token_ids:
                    waited = steps - probe_after
                probe_tokens += out.new_token_ids
            else:
                tokens[out.request_id] += out.new_token_ids
    return tokens, waited, probe_tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_probe_beside_a_flood_gets_its_first_token_within_the_bound_and_the_flood_loses_nothing(
        tiny_model_dir, async_scheduling):
    engine = _flood_engine(tiny_model_dir, async_scheduling=async_scheduling)
    alone, _, _ = _run(engine, probe_after=None)
    beside, waited, probe_tokens = _run(engine, probe_after=10)
    # Admitted within the bound (plus the step reading its token back when scheduling is async), far
    # below the rest of a flood request (FLOOD_TOKENS - 10 steps).
    assert waited is not None and waited <= BOUND + 2 + async_scheduling, waited
    assert len(probe_tokens) == 2
    assert engine.stats()["num_fairness_preemptions"] >= 1
    assert beside == alone and all(len(t) == FLOOD_TOKENS for t in alone.values())    # recomputed exactly
    st = engine.stats()
    assert st["running"] == st["waiting"] == st["used_kv_blocks"] == st["num_scheduled_clients"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_fairness_on_cuda_with_graphs_and_async_scheduling(tiny_model_dir):
    # Victims preempted while their step is still in flight on the device, recomputed through the graphs.
    engine = _flood_engine(tiny_model_dir, device="cuda", attention_backend="triton", num_kv_blocks=256)
    assert engine.async_scheduling and engine.runner.graphs is not None
    alone, _, _ = _run(engine, probe_after=None)
    beside, waited, probe_tokens = _run(engine, probe_after=10)
    assert waited is not None and waited <= BOUND + 3, waited
    assert beside == alone and len(probe_tokens) == 2
    assert engine.stats()["num_fairness_preemptions"] >= 1


def test_engine_fairness_with_speculative_decoding(tiny_model_dir, tmp_path):
    from llmserve_core.models.tiny_draft import make_tiny_draft
    draft = make_tiny_draft(tmp_path / "draft", tiny_model_dir, seed=1)
    engine = _flood_engine(tiny_model_dir, speculative_model=str(draft), speculative_policy="always")
    alone, _, _ = _run(engine, probe_after=None, n_flood=8)
    beside, waited, probe_tokens = _run(engine, probe_after=4, n_flood=8)
    assert waited is not None and waited <= BOUND + 2, waited
    assert beside == alone and len(probe_tokens) == 2
    assert engine.stats()["num_fairness_preemptions"] >= 1


@pytest.mark.parametrize("value", [-1, -2**63, 2**31, 2**63, 2**64])
def test_a_fairness_bound_out_of_range_is_refused_by_name(tiny_model_dir, value):
    with pytest.raises(ValueError, match="fairness_preempt_steps"):
        EngineConfig(model=str(tiny_model_dir), fairness_preempt_steps=value).validate()


def test_the_fairness_flag_reaches_the_engine_config(tiny_model_dir, capsys):
    from llmserve_core.cli import parse_serve_args
    assert parse_serve_args(["--model", str(tiny_model_dir), "--fairness-preempt-steps", "0"])[0].fairness_preempt_steps == 0
    assert parse_serve_args(["--model", str(tiny_model_dir)])[0].fairness_preempt_steps == 8
    with pytest.raises(SystemExit) as e:
        parse_serve_args(["--model", str(tiny_model_dir), "--fairness-preempt-steps", "-3"])
    assert e.value.code == 2 and "--fairness-preempt-steps" in capsys.readouterr().err


def test_short_of_blocks_the_client_running_the_most_gives_up_its_newest():
    # P's request is the newest running, but F runs more: F's newest goes when an older F request needs a block.
    s = Scheduler(BlockManager(9, 4), max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    flood = [req(f"f{i}", "F", n_prompt=4) for i in range(3)]
    for r in flood:
        s.add(r)
    step(s)
    probe = req("p", "P", n_prompt=4, max_tokens=20)
    s.add(probe)
    preempted = []
    for _ in range(8):
        preempted += [r.request_id for r in step(s).preempted]
    assert preempted and "p" not in preempted and probe.num_output_tokens == 8, preempted
    assert preempted[0] == "f2"              # the newest of the client running the most
