"""The exponential race in one pass: each row's token = argmax(logits / T - log E), E ~ Exp(1) given.

That is argmax(p / E) with p = softmax(logits / T) (the softmax's normalizer does not move an argmax), so
a sampled row needs neither its probabilities nor a softmax: one read of the logits and of the noise, where
the torch composition makes about ten passes over the [rows, vocab] float32 tensors (0.7 ms a step at 256
rows of Qwen3's 152k vocabulary on the H200). Rows with temperature 0 take the argmax of their logits.
NaN scores count as -inf; a row whose best score is not finite (an infinite logit, or nothing finite to
draw from) takes the argmax of its logits, as layers/sampler.py's torch path does.

Each program reduces one chunk of one row's vocabulary to its best (score, index), the lowest index on
ties; the chunks of a row are then compared on the device (few per row: enough programs to fill the card).
Its torch reference, which the CPU runs, is kernels/sampling_reference.py (importable without Triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels import tuned

BLOCK = 1024


# One compiled variant whatever the batch: Triton would otherwise specialize a chunk count of 1 (large
# batches, verify rows) apart from the others, compiling after the warm-up.
@triton.jit(do_not_specialize=["chunk", "num_chunks"])
def _race_kernel(logits_ptr, noise_ptr, temp_ptr, best_ptr, best_idx_ptr, raw_ptr, raw_idx_ptr, V, chunk,
                 stride_l, stride_n, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    inv = tl.where(temp > 0, 1.0 / tl.maximum(temp, 1e-30), 0.0)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    raw = tl.full([BLOCK], float("-inf"), tl.float32)
    raw_i = tl.zeros([BLOCK], tl.int32)
    row_l = logits_ptr + row.to(tl.int64) * stride_l
    row_n = noise_ptr + row.to(tl.int64) * stride_n
    for start in range(0, chunk, BLOCK):
        cols = c * chunk + start + lanes
        mask = (start + lanes < chunk) & (cols < V)
        logit = tl.load(row_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        logit = tl.where(logit == logit, logit, float("-inf"))
        score = tl.where(temp > 0, logit * inv - tl.log(tl.load(row_n + cols, mask=mask, other=1.0)), logit)
        score = tl.where(score == score, score, float("-inf"))
        take = score > best
        best = tl.where(take, score, best)
        best_i = tl.where(take, cols, best_i)
        take = logit > raw
        raw = tl.where(take, logit, raw)
        raw_i = tl.where(take, cols, raw_i)
    top = tl.max(best, 0)
    top_i = tl.min(tl.where(best == top, best_i, 2147483647), 0)
    top_raw = tl.max(raw, 0)
    top_raw_i = tl.min(tl.where(raw == top_raw, raw_i, 2147483647), 0)
    out = row * num_chunks + c
    tl.store(best_ptr + out, top)
    tl.store(best_idx_ptr + out, top_i)
    tl.store(raw_ptr + out, top_raw)
    tl.store(raw_idx_ptr + out, top_raw_i)


def race_argmax(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor,
                num_chunks: int | None = None) -> torch.Tensor:
    """logits [N, V] (any float dtype), temperature [N] float32 (0: greedy), noise [N, V] Exp(1) float32
    -> tokens [N] int64."""
    n, v = logits.shape
    assert temperature.shape == (n,) and noise.shape == (n, v), "race_argmax: one temperature and noise row per row"
    # (the lm_head's logits and the noise are contiguous; an edited view would be copied once here)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    noise = noise if noise.stride(1) == 1 else noise.contiguous()
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    if num_chunks is None:    # about four programs per multiprocessor, each over at least a few blocks
        num_chunks = max(1, min(triton.cdiv(4 * tuned.device_spec(logits.device).sms, n), triton.cdiv(v, 4 * BLOCK)))
    chunk = triton.cdiv(triton.cdiv(v, num_chunks), BLOCK) * BLOCK
    num_chunks = triton.cdiv(v, chunk)
    best = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    raw = torch.empty_like(best)
    best_idx = torch.empty(n, num_chunks, dtype=torch.int32, device=logits.device)
    raw_idx = torch.empty_like(best_idx)
    _race_kernel[(n, num_chunks)](logits, noise, temperature.float().contiguous(), best, best_idx, raw, raw_idx, v,
                                  chunk, logits.stride(0), noise.stride(0), num_chunks, BLOCK=BLOCK, num_warps=4)
    top, at = best.max(dim=1)        # ties: the first chunk, so the lowest index
    token = best_idx.gather(1, at[:, None]).squeeze(1)
    greedy = raw_idx.gather(1, raw.argmax(dim=1, keepdim=True)).squeeze(1)
    return torch.where(torch.isfinite(top), token, greedy).long()
