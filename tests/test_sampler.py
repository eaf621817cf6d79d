"""Sampler: filters against a plain reference, and empirical frequencies against the target (chi-square)."""
import math

import pytest
import torch

from llmserve_core.layers.sampler import SamplingTensors, sample, sampling_probs
from llmserve_proto import SamplingParams

# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59}


def reference_probs(logits, p: SamplingParams):
    """One row, written as plainly as possible: temperature, then top-k, top-p, min-p."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(order if p.top_k <= 0 else order[:p.top_k])
    # top-p over the top-k survivors, renormalized
    total = sum(probs[i] for i in keep)
    mass, kept = 0.0, set()
    for i in order:
        if i not in keep:
            continue
        if mass >= p.top_p:
            break
        kept.add(i)
        mass += probs[i] / total
    probs = [probs[i] if i in kept else 0.0 for i in range(len(probs))]
    top = max(probs)
    probs = [q if q >= p.min_p * top else 0.0 for q in probs]
    s = sum(probs)
    return [q / s for q in probs]


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", CASES)
def test_filters_match_reference(params):
    torch.manual_seed(0)
    logits = torch.randn(3, 10) * 2
    st = SamplingTensors.from_params([params] * 3, [None] * 3, "cpu")
    got = sampling_probs(logits, st)
    for row in range(3):
        want = reference_probs(logits[row], params)
        assert got[row].tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("params", CASES)
def test_sample_frequencies_follow_target(params):
    torch.manual_seed(1)
    logits = torch.randn(8) * 1.5
    target = reference_probs(logits, params)
    n = 40_000
    st = SamplingTensors.from_params([params] * n, [None] * n, "cpu")
    tokens = sample(logits.expand(n, -1).contiguous(), st).token_ids
    counts = torch.bincount(tokens, minlength=8).tolist()
    assert all(c == 0 for c, t in zip(counts, target) if t == 0.0), "sampled a filtered-out token"
    support = [(c, t) for c, t in zip(counts, target) if t > 0]
    chi2 = sum((c - n * t) ** 2 / (n * t) for c, t in support)
    df = len(support) - 1
    if df == 0:
        return
    assert chi2 < CHI2_999[df], f"chi2 {chi2:.1f} with {df} dof: {counts} vs {[round(n * t) for t in target]}"


def test_mixed_batch_greedy_rows_stay_greedy():
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=2.0, top_k=2)]
    st = SamplingTensors.from_params(params, [None] * 4, "cpu")
    for _ in range(20):
        out = sample(logits, st).token_ids
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
        assert out[3] in logits[3].topk(2).indices


def test_seeded_rows_reproducible_regardless_of_position():
    torch.manual_seed(3)
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=1.0)
    g = lambda: torch.Generator().manual_seed(42)   # noqa: E731
    a = sample(logits, SamplingTensors.from_params([p] * 3, [None, g(), None], "cpu")).token_ids[1]
    b = sample(logits[[1, 0, 2]][[1, 0, 2]], SamplingTensors.from_params([p] * 3, [None, g(), None], "cpu")).token_ids[1]
    c = sample(logits[1:2], SamplingTensors.from_params([p], [g()], "cpu")).token_ids[0]
    assert a == b == c
    assert not math.isnan(float(a))
