"""kernels/sampling.py's one-pass exponential race against its torch reference (in Triton's interpreter on
the CPU, compiled on a GPU), its edge rows, and the distribution it draws from."""
from __future__ import annotations

import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels.sampling import BLOCK, race_argmax
from llmserve_core.kernels.sampling_reference import race_argmax_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def case(rows: int, vocab: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(DEVICE, dtype)
    noise = torch.empty(rows, vocab).exponential_(generator=g).to(DEVICE)
    temps = torch.tensor([(0.0, 1e-5, 0.7, 1.0, 2.5)[i % 5] for i in range(rows)], device=DEVICE)
    return logits, temps, noise


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab,chunks", [(5, 3000, None), (7, 2 * BLOCK + 5, 3), (3, 5, 1), (10, 1500, 2)])
def test_race_matches_the_reference(rows, vocab, chunks, dtype):
    logits, temps, noise = case(rows, vocab, seed=rows * vocab, dtype=dtype)
    got = race_argmax(logits, temps, noise, num_chunks=chunks)
    assert got.dtype == torch.long and got.shape == (rows,)
    assert got.tolist() == race_argmax_reference(logits, temps, noise).tolist()
    greedy = temps == 0
    assert got[greedy].tolist() == logits.float()[greedy].argmax(-1).tolist()
    # Column-strided views (an edited copy of the logits) take the same draw.
    assert race_argmax(logits.t().contiguous().t(), temps, noise, num_chunks=chunks).tolist() == got.tolist()


def test_edge_rows():
    vocab = 2 * BLOCK + 3
    logits, _, noise = case(5, vocab, seed=1)
    temps = torch.ones(5, device=DEVICE)
    logits[0, 1500] = float("inf")                     # an infinite logit wins, as the argmax
    logits[1] = float("-inf")
    logits[1, 7] = 0.0                                 # one finite token
    logits[2, ::2] = float("nan")                      # NaNs are never drawn
    logits[3] = float("nan")                           # nothing to draw: some index, never garbage
    logits[4] = 1.0                                    # a tie everywhere, equal noise: the lowest index
    noise[4] = 1.0
    got = race_argmax(logits, temps, noise, num_chunks=3).tolist()
    assert got[0] == 1500 and got[1] == 7 and got[2] % 2 == 1 and 0 <= got[3] < vocab and got[4] == 0
    assert got[:3] + got[4:] == [t for i, t in enumerate(race_argmax_reference(logits, temps, noise).tolist())
                                 if i != 3]


def test_the_race_draws_softmax_of_logits_over_temperature():
    torch.manual_seed(3)
    n, temp = (20000 if CUDA else 1200), 0.8        # (the interpreter runs a program a row)
    base = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    logits = base.repeat(n, 1).to(DEVICE)
    noise = torch.empty(n, 5).exponential_().to(DEVICE)
    tokens = race_argmax(logits, torch.full((n,), temp, device=DEVICE), noise).cpu()
    freq = torch.bincount(tokens, minlength=5).float() / n
    want = torch.softmax(base / temp, 0)
    assert ((freq - want).abs() < 4.5 * (want * (1 - want) / n).sqrt()).all(), (freq, want)
