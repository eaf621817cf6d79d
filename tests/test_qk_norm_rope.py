"""The fused q/k-norm + rotary kernel against the eager composition (interpreter on CPU, compiled on CUDA)."""
import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (interpreter on CPU)
from llmserve_core.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from llmserve_core.layers.rotary import RotaryEmbedding

CUDA = torch.cuda.is_available()


def run_case(T, hq, hk, d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 3).to(dtype).to(device)
    pos = torch.randint(0, 500, (T,), generator=g).to(device)
    qw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(device)
    kw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(device)
    rot = RotaryEmbedding(d, 512, 10000.0, None, 512, dtype, device)
    q, k = qk_norm_rope(qkv, pos, qw, kw, rot.cos, rot.sin, 1e-6, hq, hk, d)
    rq, rk = qk_norm_rope_reference(qkv, pos, qw, kw, rot.cos, rot.sin, 1e-6, hq, hk, d)
    return q, k, rq, rk


@pytest.mark.parametrize("T,hq,hk,d", [(1, 4, 2, 16), (5, 4, 4, 32), (3, 8, 2, 8)])
def test_matches_reference_float32(T, hq, hk, d):
    q, k, rq, rk = run_case(T, hq, hk, d, torch.float32, "cuda" if CUDA else "cpu", seed=T + d)
    torch.testing.assert_close(q, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64, 777])
def test_matches_reference_bf16_qwen3_8b_heads(T):
    q, k, rq, rk = run_case(T, 32, 8, 128, torch.bfloat16, "cuda", seed=T)
    # The kernel rotates in float32 and rounds once; eager rounds after each op: allow a few bf16 ulps.
    torch.testing.assert_close(q.float(), rq.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(k.float(), rk.float(), atol=0.05, rtol=0.02)
