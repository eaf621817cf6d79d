"""Checking that sampled outputs follow the target's exact distribution (speculation must be lossless)."""
from __future__ import annotations

import math

import torch


def chi2_critical(df: int, z: float = 3.5) -> float:
    """Upper critical value of chi-square (Wilson-Hilferty); z = 3.5 gives a false alarm rate near 2e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def exact_distribution(hf, prompt, top_k, length):
    """P(first `length` generated tokens) under temperature 1 and top-k, straight from transformers."""
    out = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in out.items():
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([prompt + list(seq)])).logits[0, -1]
            top = logits.topk(top_k)
            for t, q in zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()):
                grown[seq + (t,)] = p * q
        out = grown
    return out


def assert_matches_distribution(outputs: list[list[int]], expected: dict) -> None:
    """A chi-squared test of the outputs' frequencies against `expected` (cells under 5 expected pooled)."""
    n = len(outputs)
    counts: dict = {}
    for out in outputs:
        key = tuple(out)
        assert key in expected, f"sampled {key}, which has probability zero"
        counts[key] = counts.get(key, 0) + 1
    cells = [k for k, p in expected.items() if p * n >= 5]
    rest = 1 - sum(expected[k] for k in cells)
    stat = sum((counts.get(k, 0) - expected[k] * n) ** 2 / (expected[k] * n) for k in cells)
    if rest * n >= 5:
        other = n - sum(counts.get(k, 0) for k in cells)
        stat += (other - rest * n) ** 2 / (rest * n)
    df = len(cells) - (0 if rest * n >= 5 else 1)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} over {df} dof"
