"""The decode kernel handed the packed qkv rows (paged_decode(..., prep=HeadPrep)): it norms and rotates q
and k and stores the new K/V itself. Against the two launches it replaces (qk_norm_rope_store, then the
decode over q) and against the torch references (the unfused norm + rotary + store, then paged attention),
on fresh random inputs: one piece and split pieces, every model dtype, a cache of the model's dtype and an
FP8 one, with and without q/k norm, a graph-padding row, rows handed to o_proj quantized. Interpreter on
the CPU, compiled on CUDA (Qwen3-8B heads there)."""
from __future__ import annotations

import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels.attention_reference import paged_attention_reference
from llmserve_core.kernels.fp8_format import FP8, RowQuant
from llmserve_core.kernels.paged_decode import DecodeScratch, paged_decode
from llmserve_core.kernels.qk_norm_rope import HeadPrep, qk_norm_rope_store, qk_norm_rope_store_reference
from llmserve_core.layers.rotary import RotaryEmbedding
from test_kernels import paged_cache, rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def decode_case(seq_lens, hq, hk, d, block_size, dtype, kv, seed, norm=True, device=DEVICE):
    """(qkv rows, HeadPrep, caches, block tables, lengths, cache scales): row b is sequence b's new token at
    position seq_lens[b] - 1 (a zero length: a graph-padding row, slot -1)."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt = paged_cache(seq_lens, block_size, hk, d, torch.float32, device, gen)
    scales = (0.05, 0.02) if kv == "fp8" else (1.0, 1.0)
    kc, vc = ((kc / scales[0]).clamp(-448, 448).to(FP8), (vc * 0.5 / scales[1]).clamp(-448, 448).to(FP8)) \
        if kv == "fp8" else (kc.to(dtype), vc.to(dtype))
    qkv = (torch.randn(len(seq_lens), (hq + 2 * hk) * d, generator=gen) * 3).to(dtype).to(device)
    rot = RotaryEmbedding(d, 4096, 10000.0, None, 4096, dtype, device)
    positions = torch.tensor([max(n - 1, 0) for n in seq_lens], device=device)
    slots = torch.tensor([int(bt[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
                          for b, n in enumerate(seq_lens)], device=device)
    weights = [(torch.rand(d, generator=gen) + 0.5).to(dtype).to(device) if norm else None for _ in range(2)]
    prep = HeadPrep(weights[0], weights[1], 1e-6, rot.cos, rot.sin, positions, slots)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return qkv, prep, kc, vc, bt, lens, scales


def q_view(qkv, hq, d):
    return qkv[:, :hq * d].view(qkv.shape[0], hq, d)


def both_ways(seq_lens, hq, hk, d, block_size, dtype, kv, seed, norm=True, device=DEVICE, **kw):
    """(fused output, its caches), (unfused output, its caches), and the references' output and caches."""
    qkv, prep, kc, vc, bt, lens, (k_scale, v_scale) = decode_case(seq_lens, hq, hk, d, block_size, dtype, kv,
                                                                  seed, norm, device)
    caches = [(kc.clone(), vc.clone()) for _ in range(3)]
    scale = d ** -0.5
    common = dict(k_scale=k_scale, v_scale=v_scale, **kw)
    fused = paged_decode(q_view(qkv, hq, d), *caches[0], bt, lens, scale, prep=prep, scratch=DecodeScratch(),
                         **common)
    q = qk_norm_rope_store(qkv, prep.positions, prep.slot_mapping, prep.q_weight, prep.k_weight, prep.cos,
                           prep.sin, prep.eps, hq, hk, d, *caches[1], k_scale, v_scale)
    unfused = paged_decode(q, *caches[1], bt, lens, scale, scratch=DecodeScratch(), **common)
    rq = qk_norm_rope_store_reference(qkv, prep.positions, prep.slot_mapping, prep.q_weight, prep.k_weight,
                                      prep.cos, prep.sin, prep.eps, hq, hk, d, *caches[2], k_scale, v_scale)
    ref = paged_attention_reference(rq, *caches[2], lens, bt, scale, k_scale=k_scale, v_scale=v_scale)
    return (fused, caches[0]), (unfused, caches[1]), (ref, caches[2])


def same_bits(a, b) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8 else torch.equal(a, b)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype,kv", [(torch.float32, "model"), (torch.bfloat16, "model"), (torch.float16, "fp8")])
def test_prepared_decode_is_the_two_launches_it_replaces(dtype, kv, num_splits):
    """Bit for bit in the interpreter (the same arithmetic in the same order); the torch references agree
    within the dtype's tolerance. Sequence lengths put the new token first, last and inside a piece's
    tiles, and the empty row (graph padding) stores nothing."""
    seq_lens = [70, 9, 0, 33, 1, 64]
    (out, caches), (out2, caches2), (ref, ref_caches) = both_ways(seq_lens, 4, 2, 16, 8, dtype, kv,
                                                                  seed=num_splits + len(kv), num_splits=num_splits)
    if not CUDA:
        assert torch.equal(out, out2)
        assert all(same_bits(a, b) for a, b in zip(caches, caches2))
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype] and not out[2].float().any()
    for got, want in zip(caches, ref_caches):
        assert (got.float() == want.float()).float().mean() > 0.99


def test_prepared_decode_without_qk_norm_and_with_quantized_rows():
    """A draft's heads (no q/k norm) and o_proj's rows quantized per head: codes and scales equal those of
    the unfused launches."""
    seq_lens = [5, 40, 17]
    quant = RowQuant(32)
    (codes, _), (codes2, _), _ = both_ways(seq_lens, 4, 1, 32, 16, torch.bfloat16, "model", seed=3, norm=False,
                                           num_splits=2, quant=quant)
    (plain, _), _, (ref, _) = both_ways(seq_lens, 4, 1, 32, 16, torch.bfloat16, "model", seed=3, norm=False,
                                        num_splits=2)
    assert rel_err(plain, ref) < TOL[torch.bfloat16]
    if not CUDA:
        assert same_bits(codes[0], codes2[0]) and torch.equal(codes[1], codes2[1])


def test_prepared_decode_refuses_what_it_cannot_prepare():
    qkv, prep, kc, vc, bt, lens, _ = decode_case([5, 9], 4, 2, 16, 8, torch.float32, "model", seed=1)
    with pytest.raises(AssertionError, match="packed qkv rows"):
        paged_decode(q_view(qkv, 4, 16).contiguous(), kc, vc, bt, lens, 0.3, prep=prep)
    with pytest.raises(AssertionError, match="prep is a decode's"):
        paged_decode(q_view(qkv, 4, 16), kc, vc, bt, lens[:1], 0.3, prep=prep, rows_per_seq=2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, "model"), (torch.bfloat16, "fp8"), (torch.float16, "model"),
                                      (torch.float32, "model")])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_gpu_prepared_decode_at_qwen3_8b_heads(dtype, kv, batch):
    """Qwen3-8B's heads (32 q, 8 KV, head_dim 128), 16-token pages, the batch's own split count, under PDL
    and not: the new K/V land as the unfused kernel stores them, and the output agrees with the two
    launches (the same arithmetic, compiled into two kernels) and with the torch references."""
    seq_lens = [1 + (37 * i + 500) % 900 for i in range(batch)]
    for pdl in (False, True):
        (out, caches), (out2, caches2), (ref, ref_caches) = both_ways(seq_lens, 32, 8, 128, 16, dtype, kv,
                                                                      seed=batch, device="cuda", pdl=pdl)
        assert rel_err(out, out2) < TOL[dtype] / 4 and rel_err(out, ref) < TOL[dtype]
        for got, want in zip(caches, caches2):
            assert (got.float() == want.float()).float().mean() > 0.999
