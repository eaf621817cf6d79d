"""The adaptive speculation policy on a fake cost model and fake acceptance streams (no engine)."""
from __future__ import annotations

import math
import random

import pytest

from llmserve_core.speculative.policy import AcceptanceModel, Decision, MeasuredCosts, SpecPolicy, batch_bucket

CHAIN = {1: 2, 2: 3, 3: 4, 4: 5}         # depth -> verify rows per request


class FakeCosts:
    """Step seconds from a formula: a plain step costs `plain`, each extra verify row `per_row` times the
    bucket (verify grows compute-bound as the batch grows), each draft `per_draft`."""

    def __init__(self, plain=1.0, per_row=0.02, per_draft=0.03):
        self.plain, self.per_row, self.per_draft = plain, per_row, per_draft

    def step_seconds(self, bucket, width):
        if width == 1:
            return self.plain
        return self.plain * (1 + self.per_row * bucket * (width - 1) + self.per_draft * (width - 1))


def run(policy, costs, accept_prob, steps, batch=8, seed=0):
    """Drive the policy as the engine does: a step after plain steps only warms the draft up (nobody
    drafts), later steps report each request's accepted drafts, drawn with per-draft probability."""
    rnd = random.Random(seed)
    decisions = []
    prev = 0
    for i in range(steps):
        d = policy.decide(batch, batch, costs)
        p = accept_prob(i) if callable(accept_prob) else accept_prob
        if d.gamma and prev:
            accepted = []
            for _ in range(batch):
                a = 0
                while a < d.gamma and rnd.random() < p:
                    a += 1
                accepted.append(a)
            policy.observe(d, accepted)
        elif d.gamma:
            policy.observe(d, [])
        decisions.append(d)
        prev = d.gamma
    return decisions


def test_high_acceptance_and_cheap_verify_draft_deep():
    policy = SpecPolicy(CHAIN)
    decisions = run(policy, FakeCosts(per_row=0.005), 0.9, 200, batch=4)
    assert [d.gamma for d in decisions[-50:]] == [4] * 50
    assert policy.acceptance.conditional(0) > 0.8


def test_useless_drafts_converge_to_plain_with_rare_growing_probes():
    policy = SpecPolicy(CHAIN, probe_every=8, probe_every_max=512)
    decisions = run(policy, FakeCosts(), 0.0, 4000)
    drafted = [i for i, d in enumerate(decisions) if d.gamma]
    assert len(drafted) < 0.01 * len(decisions), len(drafted)
    assert all(decisions[i].probe for i in drafted[4:])       # after the first tries, only probes draft
    starts = [i for i in drafted if i - 1 not in drafted]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > 400              # probes grow rarer, up to the cap
    assert [d.gamma for d in decisions[-100:]].count(0) >= 98
    assert policy.acceptance.expected_emitted(4) < 1.05


def test_expensive_verify_at_large_batch_drafts_shallower_then_not_at_all():
    costs = FakeCosts(per_row=0.02, per_draft=0.02)
    chosen = {}
    for batch in (1, 16, 64, 256):
        policy = SpecPolicy(CHAIN)
        decisions = run(policy, costs, 0.8, 300, batch=batch)
        chosen[batch] = max(set(d.gamma for d in decisions[-60:]), key=[d.gamma for d in decisions[-60:]].count)
    assert chosen[1] == 4
    assert 0 < chosen[16] < 4
    assert chosen[256] == 0
    assert chosen[1] >= chosen[16] >= chosen[64] >= chosen[256]


def test_acceptance_that_returns_is_noticed_by_a_probe():
    policy = SpecPolicy(CHAIN, probe_every=8, probe_every_max=64)
    decisions = run(policy, FakeCosts(per_row=0.005), lambda i: 0.0 if i < 600 else 0.9, 1000, batch=4)
    assert [d.gamma for d in decisions[550:600]].count(0) >= 45
    assert [d.gamma for d in decisions[-100:]] == [4] * 100


def test_always_mode_and_no_speculative_requests():
    always = SpecPolicy({3: 11}, mode="always")
    assert all(d == Decision(3) for d in run(always, FakeCosts(per_row=10.0), 0.0, 20))
    adaptive = SpecPolicy(CHAIN)
    assert adaptive.decide(8, 0, FakeCosts()) == Decision(0)
    assert adaptive.num_plain_steps == 1 and adaptive.num_drafted_steps == 0


def test_plain_steps_are_measured_before_any_draft():
    policy = SpecPolicy(CHAIN)
    costs = MeasuredCosts()
    assert policy.decide(4, 4, costs).gamma == 0
    costs.record(batch_bucket(4), 1, 0.01)
    # Nothing measured for drafting yet: the hopeful prior (acceptance 0.6, 25% per draft) tries it.
    assert policy.decide(4, 4, costs).gamma > 0


def test_acceptance_model_expectation_and_decay():
    m = AcceptanceModel(3, prior=0.5, prior_weight=1.0, decay=1.0)
    assert m.expected_emitted(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    m.record([3, 3, 1, 0], 3)             # pos 0: 3 of 4; pos 1: 2 of 3; pos 2: 2 of 2
    assert m.conditional(0) == pytest.approx((3 + 0.5) / 5)
    assert m.conditional(1) == pytest.approx((2 + 0.5) / 4)
    assert m.conditional(2) == pytest.approx((2 + 0.5) / 3)
    decaying = AcceptanceModel(1, decay=0.5)
    for _ in range(30):
        decaying.record([1] * 10, 1)
    for _ in range(30):
        decaying.record([0] * 10, 1)
    assert decaying.conditional(0) < 0.05      # old observations fade (the prior stays, worth one)


def test_measured_costs_median_fallback_and_garbage():
    c = MeasuredCosts(window=3)
    c.record(4, 1, 1.0)
    c.record(4, 1, 3.0)
    assert c.step_seconds(4, 1) == 2.0
    for bad in (math.nan, math.inf, -1.0, 0.0, -math.inf):
        c.record(4, 1, bad)
    assert c.step_seconds(4, 1) == 2.0
    c.record(4, 1, 1e-300)
    assert c.step_seconds(4, 1) == 1.0                          # median of 1, 3, 1e-300
    assert c.step_seconds(64, 1) is None and c.step_seconds(64, 4) is None
    c = MeasuredCosts()
    c.record(4, 1, 1.0)
    c.record(4, 4, 2.0)
    c.record(64, 1, 3.0)
    assert c.step_seconds(64, 4) == pytest.approx(6.0)          # the ratio measured at bucket 4
    assert c.step_seconds(64, 5) is None
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 5, 256, 257)] == [1, 1, 2, 4, 8, 256, 512]
    with pytest.raises(ValueError, match="window"):
        MeasuredCosts(window=0)


def test_one_stalled_step_does_not_move_a_measured_cost():
    """A moving average let one stalled plain step (a collection, a page fault) make plain decoding look
    slower than drafting for many steps; the median ignores it, and the window forgets old samples."""
    c = MeasuredCosts(window=9)
    for _ in range(8):
        c.record(256, 1, 0.030)
    c.record(256, 1, 2.0)                                       # one stall, 66x the step
    assert c.step_seconds(256, 1) == pytest.approx(0.030)
    for _ in range(9):
        c.record(256, 1, 0.040)                                 # the machine got slower: followed
    assert c.step_seconds(256, 1) == pytest.approx(0.040)


class DraftingLooksCheap:
    """A cost model whose drafting steps measured cheaper than plain ones (what a stall charged to plain
    decoding, or timing noise, can make it say)."""

    def step_seconds(self, bucket, width):
        return 1.0 if width == 1 else 0.8


def test_useless_drafts_stay_plain_even_when_drafting_measured_cheaper():
    policy = SpecPolicy(CHAIN, probe_every=8, probe_every_max=512)
    decisions = run(policy, DraftingLooksCheap(), 0.0, 2000, batch=256)
    drafted = [d for d in decisions if d.gamma]
    # The hopeful first try takes two steps (the first only warms the draft up); after it, probes only.
    assert not any(d.probe for d in drafted[:2]) and all(d.probe for d in drafted[2:])
    assert len(drafted) < 40
    assert policy.expected_rate(4, 256, 0, 256, DraftingLooksCheap()) <= 256 / 1.0 * 1.001


def test_bad_policy_arguments():
    with pytest.raises(ValueError, match="speculative_policy"):
        SpecPolicy(CHAIN, mode="sometimes")
    with pytest.raises(ValueError, match="widths"):
        SpecPolicy({})


def test_engine_times_only_decode_steps_that_follow_decode_steps():
    """An async plain step's wall time is the wait for its predecessor: after a step that carried a prefill
    chunk it would charge that chunk to plain decoding, so it is not recorded."""
    from types import SimpleNamespace

    from llmserve_core.engine.engine import Engine
    from llmserve_core.speculative.policy import Decision, MeasuredCosts
    fake = SimpleNamespace(policy=SimpleNamespace(widths={3: 4}), step_costs=MeasuredCosts(), _last_step=None)
    decode = SimpleNamespace(requests=[1] * 8, total_tokens=8)
    prefill = SimpleNamespace(requests=[1] * 8, total_tokens=520)
    plain = Decision(0)
    for sched, started in ((decode, 1.0), (prefill, 2.0), (decode, 3.0)):     # nothing steady yet
        Engine._record_step_cost(fake, sched, plain, started)
    assert fake.step_costs.median == {}
    Engine._record_step_cost(fake, decode, plain, 4.0)                        # decode after decode: timed
    assert set(fake.step_costs.median) == {(8, 1)}
    Engine._record_step_cost(fake, decode, Decision(3), 5.0)                  # first drafting step: not yet
    assert set(fake.step_costs.median) == {(8, 1)}
