"""Speculative decoding algorithms that do not need the engine: verification, trees, metrics,
and the EAGLE-3 draft model in the speculators format."""
from __future__ import annotations

import math

import pytest
import torch

from llmserve_core.layers.sampler import SamplingTensors, sampling_probs
from llmserve_proto import SamplingParams
from llmserve_core.speculative.types import SpecMetrics, SpecStepResult, results_from_verify
from llmserve_core.speculative.verify import greedy_verify, rejection_sample_verify, verify_probs


def chi2_critical(df: int, z: float = 3.5) -> float:
    """Upper critical value of chi-square (Wilson-Hilferty); z = 3.5 gives a false alarm rate near 2e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_distribution(samples: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    n = counts.sum()
    expected = probs.double() * n
    assert counts[expected == 0].sum() == 0, "sampled a token of probability zero"
    live = expected > 0
    stat = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    df = int(live.sum()) - 1
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} over {df} dof: counts {counts.tolist()} expected {expected.tolist()}"


def one_hot_logits(ids, vocab):
    logits = torch.full((len(ids), vocab), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


# ---- target distribution for verification ------------------------------------------------------

def sampling_tensors(params_list):
    return SamplingTensors.from_params(params_list, [None] * len(params_list), "cpu")


def test_verify_probs_match_sampler_and_make_greedy_rows_one_hot():
    logits = torch.randn(3, 11)
    st = sampling_tensors([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=4),
                           SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)])
    probs = verify_probs(logits, st)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 11).float())
    torch.testing.assert_close(probs[1:], sampling_probs(logits, st)[1:])
    assert int((probs[1] > 0).sum()) == 4


# ---- greedy verification --------------------------------------------------------------------------

def test_greedy_verify_exact_cases():
    vocab = 10
    # Request 0: drafts 3,4,5 vs target 3,4,9,(7): accepts 2, corrects with 9.
    # Request 1: drafts 1,2 vs target 1,2,(8): all accepted, bonus 8.
    # Request 2: no drafts: just the target's token 6.
    # Request 3: drafts 5 vs target 0: nothing accepted, correction 0.
    target = [3, 4, 9, 7, 1, 2, 8, 6, 0, 1]
    drafts = torch.tensor([[3, 4, 5], [1, 2, -1], [-1, -1, -1], [5, -1, -1]])
    out = greedy_verify(one_hot_logits(target, vocab), drafts, torch.tensor([3, 2, 0, 1]))
    assert out.num_accepted.tolist() == [2, 2, 0, 0]
    assert out.token_lists() == [[3, 4, 9], [1, 2, 8], [6], [0]]
    assert out.token_ids[2].tolist() == [6, -1, -1, -1]


def test_greedy_verify_rejects_bad_layout():
    with pytest.raises(ValueError, match="target rows"):
        greedy_verify(torch.randn(3, 5), torch.zeros(1, 3, dtype=torch.long), torch.tensor([3]))
    with pytest.raises(ValueError, match="num_draft"):
        greedy_verify(torch.randn(5, 5), torch.zeros(1, 3, dtype=torch.long), torch.tensor([4]))


def test_rejection_sampling_with_greedy_rows_equals_greedy_verify():
    torch.manual_seed(0)
    vocab, k = 7, 3
    num_draft = torch.tensor([3, 1, 0, 2])
    logits = torch.randn(int((num_draft + 1).sum()), vocab)
    drafts = torch.randint(0, vocab, (4, k))
    # Make some drafts right so acceptance paths are exercised.
    drafts[0, :2] = logits[:2].argmax(-1)
    n = len(logits)
    probs = verify_probs(logits, sampling_tensors([SamplingParams(temperature=0.0)] * n))
    q = torch.softmax(torch.randn(int(num_draft.sum()), vocab), -1)
    greedy = greedy_verify(logits, drafts, num_draft)
    for draft_probs in (None, q):
        sampled = rejection_sample_verify(probs, drafts, num_draft, draft_probs)
        assert sampled.token_lists() == greedy.token_lists()


# ---- rejection sampling is lossless ------------------------------------------------------------------

@pytest.mark.parametrize("draft_kind", ["sampled", "argmax"])
def test_rejection_sampling_output_distribution_equals_target(draft_kind):
    torch.manual_seed(1)
    vocab, trials = 6, 40000
    p = torch.softmax(torch.randn(3, vocab) * 1.5, -1)   # target rows 0, 1 (after draft 1), 2 (bonus)
    p[0, 5] = 0.0                                          # a token the target never emits
    p[0] /= p[0].sum()
    q = torch.softmax(torch.randn(2, vocab) * 1.5, -1)    # arbitrary draft distributions, unrelated to p
    if draft_kind == "sampled":
        drafts = torch.stack([torch.multinomial(q[j], trials, replacement=True) for j in range(2)], 1)
        draft_probs = q.repeat(trials, 1)
    else:
        drafts = q.argmax(-1).repeat(trials, 1)
        draft_probs = None
    out = rejection_sample_verify(p.repeat(trials, 1), drafts, torch.full((trials,), 2), draft_probs)
    first = out.token_ids[:, 0]
    assert_distribution(first, p[0])
    # Given the first draft was kept, the next token must follow the target's next row.
    second = out.token_ids[out.num_accepted >= 1, 1]
    assert_distribution(second, p[1])
    third = out.token_ids[out.num_accepted == 2, 2]
    assert_distribution(third, p[2])


def test_rejection_sampling_seeded_requests_are_reproducible_across_batches():
    torch.manual_seed(2)
    vocab = 9
    p = torch.softmax(torch.randn(4, vocab), -1)
    q = torch.softmax(torch.randn(3, vocab), -1)
    drafts = torch.multinomial(q, 1).T                       # [1, 3]
    alone = [rejection_sample_verify(p, drafts, torch.tensor([3]), q, [torch.Generator().manual_seed(s)]).token_lists()[0]
             for s in range(20)]
    other_p = torch.softmax(torch.randn(2, vocab), -1)
    other_q = torch.softmax(torch.randn(1, vocab), -1)
    mixed = []
    for s in range(20):
        out = rejection_sample_verify(torch.cat([other_p, p]), torch.cat([torch.tensor([[0, -1, -1]]), drafts]),
                                      torch.tensor([1, 3]), torch.cat([other_q, q]),
                                      [None, torch.Generator().manual_seed(s)])
        mixed.append(out.token_lists()[1])
    assert alone == mixed
    assert len({tuple(x) for x in alone}) > 1


# ---- metrics ---------------------------------------------------------------------------------------

def test_metrics_accumulate():
    m = SpecMetrics()
    m.record(results_from_verify([[1, 2, 3], [4]], [3, 3]))
    m.record([SpecStepResult([5, 6, 7, 8], 3, 3)])
    assert m.num_steps == 3 and m.num_batches == 2
    assert m.acceptance_rate == pytest.approx(5 / 9)
    assert m.mean_acceptance_length == pytest.approx(8 / 3)
    assert m.per_position_acceptance == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    with m.timer("draft"):
        pass
    with pytest.raises(ValueError, match="timing key"):
        m.add_time("nope", 1.0)
    d = m.as_dict()
    assert d["spec_accepted_tokens_per_step"] == pytest.approx(2.5)
    with pytest.raises(ValueError, match="num_accepted"):
        SpecStepResult([1, 2], 0, 1)
