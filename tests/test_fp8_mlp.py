"""The fused FP8 MLP (kernels/fp8_mlp.py) against its torch reference on fresh random inputs: in Triton's
interpreter on the CPU at small shapes, and at Qwen3-8B's shape on a GPU, eager and under PDL."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels.fp8_format import dequantize_weight
from llmserve_core.kernels.fp8_mlp import DEFAULT_CONFIG, MAX_ROWS, fp8_mlp, fp8_mlp_reference, fp8_mlp_supported
from llmserve_core.layers.fp8_linear import Fp8Linear
from test_fp8_kernels import A8_TOL, random_fp8_weight
from test_kernels import rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def weights(hidden, inter, block, gen, device=DEVICE):
    wgu, sgu = random_fp8_weight(2 * inter, hidden, block, gen, device)
    wd, sd = random_fp8_weight(hidden, inter, block, gen, device)
    return wgu, sgu, wd, sd


def float_mlp(x, wgu, sgu, wd, sd, block):
    """The MLP of the dequantized weights on the unquantized activations: what FP8 approximates."""
    gate, up = (x.float() @ dequantize_weight(wgu, sgu, block).t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ dequantize_weight(wd, sd, block).t()


@pytest.mark.parametrize("atomic,arrive", [(False, 1), (False, 2), (True, 1)])
@pytest.mark.parametrize("m,hidden,inter,block,dtype,cfg", [
    (1, 64, 96, None, torch.float32, dict(BLOCK_I=32, BLOCK_K=32, BLOCK_H=32, MERGE_P=2)),
    (3, 96, 64, None, torch.float16, dict(BLOCK_I=16, BLOCK_K=32, BLOCK_H=16, MERGE_P=4)),   # merges over 4 programs
    (4, 64, 128, (32, 32), torch.float32, dict(BLOCK_I=32, BLOCK_K=32, BLOCK_H=32, MERGE_P=2)),
    (2, 64, 64, (32, 32), torch.float32, dict(BLOCK_I=16, BLOCK_K=16, BLOCK_H=32, MERGE_P=8)),  # tiles inside a block
    (1, 128, 64, (32, 32), torch.float32, dict(BLOCK_I=32, BLOCK_K=32, BLOCK_H=64, MERGE_P=2)),  # two blocks a chunk
])
def test_fp8_mlp_matches_its_reference(m, hidden, inter, block, dtype, cfg, atomic, arrive, monkeypatch):
    """To float precision against its own arithmetic (x per 1 x BLOCK_K piece, h per 1 x BLOCK_I piece),
    within e4m3's rounding of the activations against the float MLP; twice, as the counters re-arm."""
    import llmserve_core.kernels.fp8_mlp as module
    monkeypatch.setattr(module, "SCALE_BLOCK", 32)      # small blocks at small shapes
    gen = torch.Generator().manual_seed(m * 11 + hidden + inter)
    w = weights(hidden, inter, block, gen)
    x = torch.randn(m, hidden, generator=gen).to(DEVICE, dtype)
    x[0, :5] = 0.0
    config = dict(cfg, num_warps=4, num_stages=1, ATOMIC=atomic, ARRIVE=arrive)
    for _ in range(2):
        out = fp8_mlp(x, *w, block, config=config)
        assert out.shape == (m, hidden) and out.dtype == dtype
        ref = fp8_mlp_reference(x, *w, block, k_group=cfg["BLOCK_K"], h_group=cfg["BLOCK_I"])
        assert rel_err(out, ref) < max(A8_TOL, 1e-3 if dtype == torch.float16 else 0)
        assert rel_err(out, float_mlp(x, *w, block)) < 8e-2     # e4m3 rounds x and h: a few % each


def test_fp8_mlp_is_deterministic_and_zero_rows_stay_zero():
    gen = torch.Generator().manual_seed(3)
    w = weights(64, 128, None, gen)
    x = torch.randn(2, 64, generator=gen).to(DEVICE)
    x[1] = 0.0
    config = dict(BLOCK_I=16, BLOCK_K=32, BLOCK_H=32, MERGE_P=4, num_warps=4, num_stages=1)
    first = fp8_mlp(x, *w, config=config)
    assert torch.equal(first, fp8_mlp(x, *w, config=config))
    assert torch.equal(first, fp8_mlp(x, *w, config=dict(config, ARRIVE=2)))   # the same sums, in program order
    assert torch.isfinite(first).all() and first[1].abs().sum() == 0


def test_fp8_mlp_refuses_what_it_cannot_tile():
    gen = torch.Generator().manual_seed(4)
    wgu, sgu, wd, sd = weights(64, 96, None, gen)
    x = torch.randn(MAX_ROWS + 1, 64, generator=gen).to(DEVICE)
    with pytest.raises(AssertionError, match="rows"):
        fp8_mlp(x, wgu, sgu, wd, sd)
    with pytest.raises(AssertionError, match="do not divide"):       # 96 features in 128-wide slices
        fp8_mlp(x[:1], wgu, sgu, wd, sd)
    with pytest.raises(AssertionError, match="do not fit"):
        fp8_mlp(x[:1, :32], wgu, sgu, wd, sd)
    assert fp8_mlp_supported(4096, 12288, None, None) and fp8_mlp_supported(4096, 12288, (128, 128), [128, 128])
    assert not fp8_mlp_supported(4096, 12288, None, (128, 128))          # the two scaled differently
    assert not fp8_mlp_supported(4096, 12288, (64, 64), (64, 64))        # blocks the tiles do not fit
    assert not fp8_mlp_supported(4096, 12300, None, None)
    assert not fp8_mlp_supported(4096, 12288, None, None, dict(DEFAULT_CONFIG, ARRIVE=3))      # not a power of 2
    assert not fp8_mlp_supported(4096, 12288, None, None, dict(DEFAULT_CONFIG, BLOCK_H=2048, ARRIVE=4))  # 2 chunks


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_mlp_at_qwen3_8b_shape(block):
    gen = torch.Generator().manual_seed(8)
    w = weights(4096, 12288, block, gen, "cuda")
    for m in range(1, MAX_ROWS + 1):
        x = torch.randn(m, 4096, generator=gen).to("cuda", torch.bfloat16)
        ref = fp8_mlp_reference(x, *w, block)
        for pdl in (False, True):
            out = fp8_mlp(x, *w, block, pdl=pdl)
            assert rel_err(out, ref) < 8e-3
            assert rel_err(out, float_mlp(x, *w, block)) < 6e-2
        assert torch.equal(out, fp8_mlp(x, *w, block, pdl=True))



@pytest.mark.parametrize("quantization", ["channel", "block"])
@torch.no_grad()
def test_a_decode_row_of_an_fp8_model_runs_its_mlp_fused(quantization, make_random_qwen3_dir, tmp_path, monkeypatch):
    """The model's chain sends a decode row's MLP through the fused kernel where the table has its row count
    (here a small tile, in the interpreter), matching the three-launch chain within the activations' e4m3
    rounding; other row counts, and a card without a table entry (the CPU), keep the chain."""
    import llmserve_core.kernels.fp8_mlp as module
    from llmserve_core.layers.attention import get_backend
    from llmserve_core.models.config import ModelConfig
    from llmserve_core.models.loader import load_model
    from test_fp8_loading import qwen_fp8_config, write_fp8_checkpoint
    path = make_random_qwen3_dir(seed=3, tie_word_embeddings=False)
    if quantization == "block":
        path, _ = write_fp8_checkpoint(path, tmp_path / "ckpt", qwen_fp8_config((32, 32)))
    model = load_model(ModelConfig.from_hf_dir(path), path, "auto", torch.float32, "cpu", get_backend("triton", "cpu"),
                       quantization="fp8" if quantization == "channel" else None)
    model.set_fused(True, chain=True, pdl=False)
    mlp = model.model.layers[0].mlp
    assert mlp.chain and isinstance(mlp.down_proj, Fp8Linear)
    monkeypatch.setattr(module, "SCALE_BLOCK", 32)
    calls = []
    real = module.fp8_mlp
    monkeypatch.setattr(module, "fp8_mlp", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(2)
    hidden = mlp.down_proj.out_features
    config = dict(BLOCK_I=16, BLOCK_K=16, BLOCK_H=32, MERGE_P=4, num_warps=4, num_stages=1)
    for rows in (1, 3):
        x = torch.randn(rows, hidden, generator=gen)
        chain = mlp(x)                          # the CPU's table is empty
        monkeypatch.setattr(module, "fp8_mlp_config", lambda m, *a: dict(config) if m == 1 else None)
        fused = mlp(x)
        monkeypatch.setattr(module, "fp8_mlp_config", lambda *a: None)
        assert fused.shape == chain.shape == (rows, hidden)
        assert rel_err(fused, chain) < (5e-2 if rows == 1 else 1e-6)
    assert calls == [1]


def test_fp8_mlp_bench_smoke(tmp_path):
    """benchmarks/fp8_mlp_bench.py on tiny shapes in the interpreter, so the script the device runs cannot
    rot unseen: the chain and a fused tile at each row count and scale kind, checked against their references."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_mlp_bench.py"
    out = tmp_path / "mlp.json"
    subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], check=True, timeout=600,
                   capture_output=True)
    cases = json.loads(out.read_text())["kernel"]
    assert sorted(cases) == sorted(f"m{m}_{s}" for m in (1, 2, 4) for s in ("channel", "block"))
    for rows in cases.values():
        assert "chain" in rows and any(label.startswith("fused_") for label in rows), rows
        assert all("error" not in r and r["rel_err"] < 1e-5 for r in rows.values()), rows
