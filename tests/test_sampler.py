"""Sampler: filters against a plain reference, and empirical frequencies against the target (chi-square)."""
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

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


def cuts_clear_of_float32(logits, p: SamplingParams) -> bool:
    """Whether every filter's cut falls clear of float32's resolution. The sampler works in float32, so a
    token whose probability sits within a few float32 ulps of a cut (a top-k tie, the top-p boundary, the
    min-p floor) may land on either side of it, and either answer is right; the float64 reference picks one.
    (Logits a thousandth apart at temperature 100 are such ties.)"""
    probs = sorted(torch.softmax(logits.double() / p.temperature, dim=-1).tolist(), reverse=True)

    def close(a, b):
        return abs(a - b) <= 1e-6 * max(abs(a), abs(b))
    survivors = probs if p.top_k <= 0 else probs[:p.top_k]
    if len(survivors) < len(probs) and close(survivors[-1], probs[len(survivors)]):
        return False
    total, mass = sum(survivors), 0.0
    for q in survivors:
        if mass >= p.top_p:
            break
        if close(mass, p.top_p):
            return False
        mass += q / total
    return not any(close(q, p.min_p * probs[0]) for q in survivors if q < probs[0])


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
    st = SamplingTensors.from_params([params] * 3, "cpu")
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
    st = SamplingTensors.from_params([params] * n, "cpu")
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
    st = SamplingTensors.from_params(params, "cpu")
    for _ in range(20):
        out = sample(logits, st).token_ids
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
        assert out[3] in logits[3].topk(2).indices


def test_seeded_rows_depend_on_seed_and_position_alone():
    """A seeded row's token is a function of its distribution, its seed and the position it samples: not
    of its row in the batch, the batch's other rows, or what was drawn before."""
    torch.manual_seed(3)
    logits = torch.randn(3, 100)
    p, other = SamplingParams(temperature=1.0, seed=42), SamplingParams(temperature=1.0)
    a = sample(logits, SamplingTensors.from_params([other, p, other], "cpu", positions=[0, 7, 0])).token_ids[1]
    torch.rand(1000)                                    # the global generator moves on
    b = sample(logits[[1, 0]], SamplingTensors.from_params([p, p], "cpu", positions=[7, 3])).token_ids[0]
    c = sample(logits[1:2], SamplingTensors.from_params([p], "cpu", positions=[7])).token_ids[0]
    assert a == b == c and not math.isnan(float(a))
    # Over positions (and seeds) the draws are still samples of the distribution.
    flat = torch.zeros(1, 4)
    at = [int(sample(flat, SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=s)], "cpu",
                                                        positions=[pos])).token_ids[0])
          for s in (1, 2) for pos in range(200)]
    counts = torch.bincount(torch.tensor(at), minlength=4)
    assert counts.min() > 70, counts


def test_noise_keys_are_mixed_and_fit_manual_seed():
    from llmserve_core.layers.sampler import noise_key
    keys = {noise_key(s, pos) for s in (0, 1, 2 ** 63 - 1) for pos in (0, 1, 2, 10 ** 6)}
    assert len(keys) == 12 and all(0 <= k < 2 ** 63 for k in keys)
    torch.Generator().manual_seed(max(keys))


# ---- degenerate parameters ---------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 1e-6, 9.99e-6, 0.0])
def test_temperatures_below_epsilon_are_greedy(temperature):
    torch.manual_seed(4)
    logits = torch.randn(64, 50) * 3
    st = SamplingTensors.from_params([SamplingParams(temperature=temperature, top_p=0.9)] * 64, "cpu")
    assert st.all_greedy and SamplingParams(temperature=temperature).greedy
    assert sample(logits, st).token_ids.tolist() == logits.argmax(dim=-1).tolist()
    # Mixed with sampled rows the tiny-temperature rows still take the argmax.
    mixed = [SamplingParams(temperature=temperature), SamplingParams(temperature=1.0)] * 32
    out = sample(logits, SamplingTensors.from_params(mixed, "cpu")).token_ids
    assert out[0::2].tolist() == logits[0::2].argmax(dim=-1).tolist()


def test_temperature_at_epsilon_samples_and_stays_finite():
    torch.manual_seed(5)
    logits = torch.randn(4, 30) * 50       # logits / 1e-5 reach 1e7: softmax must still be finite
    st = SamplingTensors.from_params([SamplingParams(temperature=1e-5)] * 4, "cpu")
    assert not st.all_greedy
    probs = sampling_probs(logits, st)
    assert torch.isfinite(probs).all() and probs.sum(-1).allclose(torch.ones(4))
    assert sample(logits, st).token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-30, 1e-8])
def test_tiny_top_p_keeps_only_the_top_token(top_p):
    torch.manual_seed(6)
    logits = torch.randn(5, 40)
    p = SamplingParams(temperature=1.0, top_p=top_p)
    probs = sampling_probs(logits, SamplingTensors.from_params([p] * 5, "cpu"))
    assert not torch.isnan(probs).any()
    assert probs.argmax(-1).tolist() == logits.argmax(-1).tolist()
    assert probs.max(-1).values.tolist() == pytest.approx([1.0] * 5)
    for row in range(5):
        assert probs[row].tolist() == pytest.approx(reference_probs(logits[row], p), abs=1e-6)
    tokens = sample(logits, SamplingTensors.from_params([p] * 5, "cpu")).token_ids
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("min_p", [1e-300, 1e-45, 1.0])
def test_extreme_min_p_matches_reference(min_p):
    torch.manual_seed(7)
    logits = torch.randn(3, 12) * 2
    p = SamplingParams(temperature=0.8, min_p=min_p)
    probs = sampling_probs(logits, SamplingTensors.from_params([p] * 3, "cpu"))
    for row in range(3):
        assert probs[row].tolist() == pytest.approx(reference_probs(logits[row], p), abs=1e-6)


def test_rows_without_a_distribution_take_the_greedy_token():
    logits = torch.randn(3, 10)
    logits[0, 4] = float("inf")                       # softmax of it is NaN
    logits[1] = float("-inf")
    logits[1, 7] = 0.0
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_k=3)] * 3, "cpu")
    tokens = sample(logits, st).token_ids.tolist()
    assert tokens[0] == 4 and tokens[1] == 7 and 0 <= tokens[2] < 10


EXTREME_VALID = dict(temperature=[1e-5, 1e-3, 1.0, 7.0, SamplingParams.MAX_TEMPERATURE],
                     top_p=[1e-300, 1e-30, 0.3, 1.0], min_p=[0.0, 1e-300, 0.5, 1.0], top_k=[-1, 0, 1, 3, 2**31 - 1])


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(EXTREME_VALID["temperature"]), st.sampled_from(EXTREME_VALID["top_p"]),
       st.sampled_from(EXTREME_VALID["min_p"]), st.sampled_from(EXTREME_VALID["top_k"]),
       st.sampled_from([1e-3, 1.0, 30.0, 1e4]), st.integers(0, 2**31))
def test_extreme_valid_parameters_give_the_reference_distribution(temperature, top_p, min_p, top_k, scale, seed):
    torch.manual_seed(seed)
    logits = torch.randn(2, 16) * scale
    p = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k).validate()
    st_ = SamplingTensors.from_params([p] * 2, "cpu")
    probs = sampling_probs(logits, st_)
    assert torch.isfinite(probs).all()
    tokens = sample(logits, st_).token_ids
    assert probs.sum(-1).tolist() == pytest.approx([1.0, 1.0], abs=1e-4)
    assert all(probs[row, tokens[row]] > 0 for row in range(2)), "sampled a token its own filters remove"
    assume(all(cuts_clear_of_float32(logits[row], p) for row in range(2)))
    for row in range(2):
        want = reference_probs(logits[row], p)
        assert probs[row].tolist() == pytest.approx(want, abs=1e-4)
        assert want[tokens[row]] > 0, "sampled a token the reference filters out"


def test_the_cpu_sampler_needs_no_triton():
    """Triton is an optional (GPU) dependency: sampling on the CPU must not import it."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from llmserve_core.layers.sampler import SamplingTensors, sample\n"
            "from llmserve_proto import SamplingParams\n"
            "ps = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams()]\n"
            "out = sample(torch.randn(3, 50), SamplingTensors.from_params(ps, 'cpu', positions=[4, 5, 6]))\n"
            "print(out.token_ids.tolist())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_a_rows_distribution_does_not_depend_on_its_batch_mates_filters():
    """Rows that ask for no top-p keep their whole distribution when another row of the batch turns top-p on
    (speculative verification judges drafts against these probabilities, batched with other requests). A
    peaked row over a Qwen3-sized vocabulary: float32 rounding brings the mass before its tail tokens to 1.0."""
    torch.manual_seed(0)
    logits = torch.randn(1, 151936) * 4
    mate = SamplingParams(temperature=1.0, top_p=0.9)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=100_000),
                   SamplingParams(temperature=1.0, min_p=1e-9)):
        alone = sampling_probs(logits, SamplingTensors.from_params([params], "cpu"))
        batched = sampling_probs(torch.cat([logits, logits]), SamplingTensors.from_params([params, mate], "cpu"))
        assert torch.equal(batched[0], alone[0]), params
