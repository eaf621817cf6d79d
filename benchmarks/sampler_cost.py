"""The sampler's cost per decode step at 64 and 256 rows of Qwen3's vocabulary (float32 logits, as the
lm_head hands them over), temperature 1 with nothing else (most sampled traffic): layers/sampler.sample
as it runs now (the one-pass race of kernels/sampling.py) against the torch composition it replaced
(temperature, softmax, noise, the exponential race over the probabilities, the finite-mass check and the
greedy argmax), CUDA events over many calls, in one run.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/sampler_cost.py --out $OUT/sampler_cost.json   # H200, ~15 s
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llmserve_core.layers.sampler import SamplingTensors, exponential_noise, sample, sampling_probs  # noqa: E402
from llmserve_proto import SamplingParams  # noqa: E402

VOCAB = 151936


def composed(logits, st):
    """The torch composition the race replaced (its arithmetic: argmax(softmax(l / T) / E))."""
    greedy = logits.argmax(dim=-1)
    probs = sampling_probs(logits, st)
    valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    drawn = (probs / exponential_noise(probs.shape, st.noise_keys(), probs.device)).argmax(dim=-1)
    return torch.where((st.temperature == 0) | ~valid, greedy, drawn)


def ms_per_call(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = {}
    for rows in (64, 256):
        logits = torch.randn(rows, VOCAB, device="cuda") * 3
        st = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * rows, "cuda")
        now = ms_per_call(lambda: sample(logits, st))
        before = ms_per_call(lambda: composed(logits, st))
        res[rows] = {"race_ms": now, "composed_ms": before}
        print(f"{rows} rows: sample() {now:.3f} ms, the torch composition {before:.3f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
