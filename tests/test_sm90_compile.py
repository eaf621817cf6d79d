"""Every attention and GEMV tile the wrappers pick for float32, bfloat16 and float16 at head sizes 64, 128
and 256, and the FP8 projections' tiles (TMA ones too), compiled for Hopper (sm_90) on this CPU machine as a
launch would compile them: each compiles, fits the H100/H200's shared memory, and needs no more than
kernels/tiling.py's estimate for its tile, the number the wrappers fit tiles with; the serving tiles (16-bit
attention up to head_dim 128, the 16-bit GEMVs, the FP8 projections) spill nothing; and the rest of a
step's kernels compile with the GPU-only arguments the interpreter never compiles (PDL, FP8 caches and
activations, verify trees). The GPU sweep
(test_gpu_dtypes.py) runs these tiles where a card is present; this catches a tile that cannot compile or
fit without one (issue 11's float32 prefill asked for 262,144 of 232,448 bytes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ptxas_present() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return os.access(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas"), os.X_OK)


@pytest.mark.skipif(not _ptxas_present(), reason="needs Triton's NVIDIA backend and its ptxas")
@pytest.mark.timeout(1500)
def test_every_tile_compiles_for_sm90_and_fits(tmp_path):
    out = tmp_path / "sm90.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    cache = env.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:                # Triton's compile cache: kept between runs where the home directory takes it
        os.makedirs(cache, exist_ok=True)
    except OSError:
        env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    # float32 prefill tiles take 10-20 s each to compile on a busy 2-core machine: time, not a hang
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sm90_compile.py"), "--sets",
                           "attention,gemv,fp8,chain", "--check", "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["problems"] == []
    rows = {(r["variant"], r["kernel"]): r for r in report["rows"]}
    for dtype in ("float32", "bfloat16", "float16"):
        for hd in (64, 128, 256):
            for variant, kernel in (("prefill", "_prefill_kernel"), ("prefill_short", "_prefill_kernel"),
                                    ("decode_split", "_decode_kernel"), ("decode", "_decode_kernel")):
                r = rows[(f"{variant} {dtype} d{hd}", kernel)]
                assert 0 < r["shared_bytes"] <= min(r["estimate_bytes"], report["smem_limit"]), r
                if dtype != "float32" and hd <= 128:     # the serving tiles keep everything in registers
                    assert r["stack_bytes"] == 0, r
        for m in (1, 16, 17, 64):
            r = rows[(f"gemv {dtype} rows {m}", "_gemv_kernel")]
            assert 0 < r["shared_bytes"] <= min(r["estimate_bytes"], report["smem_limit"]), r
            assert dtype == "float32" or r["stack_bytes"] == 0, r
    # the table's FP8 tiles and their TMA twins: the same shared memory give or take TMA's barriers
    for name in ("qkv", "gate_up"):
        plain, tma = rows[(f"fp8 {name} a8x", "_fp8_gemv_kernel")], rows[(f"fp8 {name} a8x tma", "_fp8_gemv_kernel")]
        assert tma["tile"]["W_TMA"] and not plain["tile"]["W_TMA"]
        assert 0 <= tma["shared_bytes"] - plain["shared_bytes"] <= 64
    assert all(r["stack_bytes"] == 0 for (variant, _), r in rows.items() if variant.startswith("fp8 ")), \
        [r for (variant, _), r in rows.items() if variant.startswith("fp8 ") and r["stack_bytes"]]
    for name in ("qkv", "o", "gate_up"):     # one row of these reads whole rows in the stream kernel
        assert rows[(f"fp8 {name} stream", "_stream_gemv_kernel")]["tile"]["DEPTH"] == 0
    # No global load waits behind a barrier after the PDL wait in the loop-free kernels of a batch-1 step
    # (such a load's latency adds to the one before it in every program: the row scales once did,
    # benchmarks/results/decode_round_trips_h100.md; down_proj's x, loaded a piece at a time, did too).
    for variant, kernel in (("fp8 qkv stream", "_stream_gemv_kernel"), ("fp8 o stream", "_stream_gemv_kernel"),
                            ("fp8 gate_up stream", "_stream_gemv_kernel"), ("fp8 down stream", "_stream_gemv_kernel"),
                            ("fp8 gate_up stream silu_mul channel", "_stream_gemv_kernel"),
                            ("fp8 gate_up stream silu_mul block", "_stream_gemv_kernel"),
                            ("rmsnorm + residual, pdl", "_rmsnorm_kernel"),
                            ("rmsnorm + residual, fp8 out, pdl", "_rmsnorm_kernel"),
                            ("qk norm + rope + store, bf16 cache, pdl", "_qk_norm_rope_store_kernel"),
                            ("qk norm + rope + store, fp8 cache, pdl", "_qk_norm_rope_store_kernel")):
        assert rows[(variant, kernel)]["late_loads"] == 0, rows[(variant, kernel)]
    # the 17-64-row tiles: x quantized ahead for qkv, gate_up and down; o_proj's 17-32 rows quantize in the kernel
    for kind in ("channel", "block"):
        for name in ("qkv", "gate_up", "down"):
            for rows_class in (32, 64):
                assert rows[(f"fp8 {name} a8x rows {rows_class} {kind}", "_fp8_gemv_kernel")]["registers"] > 0
        assert rows[(f"fp8 o a8 rows 32 {kind}", "_fp8_gemv_kernel")]["registers"] > 0
    # the GPU-only arguments the interpreter never compiles: PDL, FP8 caches and activations, verify trees
    for variant, kernel in (("rmsnorm + residual, fp8 out, pdl", "_rmsnorm_kernel"),
                            ("qk norm + rope + store, fp8 cache, pdl", "_qk_norm_rope_store_kernel"),
                            ("decode batch 1, fp8 cache, pdl", "_decode_kernel"),
                            ("decode batch 128, bf16 cache, pdl, rows quantized for o_proj", "_decode_kernel"),
                            ("decode batch 128, fp8 cache, pdl, rows quantized for o_proj", "_decode_kernel"),
                            ("verify 4 x 4 rows, tree, fp8 cache", "_decode_kernel"),
                            ("stream gemv qkv, pdl", "_stream_gemv_kernel"), ("silu_mul, pdl", "_silu_mul_kernel"),
                            ("stream gemv gate_up, silu_mul, pdl", "_stream_gemv_kernel"),
                            ("fp8 gate_up a8x silu_mul channel", "_fp8_gemv_kernel"),
                            ("fp8 gate_up a8x silu_mul block", "_fp8_gemv_kernel"),
                            ("fp8 gate_up stream silu_mul channel", "_stream_gemv_kernel"),
                            ("fp8 gate_up stream silu_mul block", "_stream_gemv_kernel"),
                            ("silu_mul, fp8 out, pdl", "_silu_mul_kernel"),
                            ("rmsnorm + residual, fp8 out per token", "_rmsnorm_kernel"),
                            ("silu_mul, fp8 out per token", "_silu_mul_row_scale_kernel"),
                            ("w8a8 gemm 512 rows, 128x128 blocks", "_w8a8_kernel")):
        assert rows[(variant, kernel)]["registers"] > 0
    # the block-scaled W8A8 prefill tile: the 128-row 4-warp one spilled 296 bytes a thread and ran 2.7-7x slower
    assert rows[("w8a8 gemm 512 rows, 128x128 blocks", "_w8a8_kernel")]["stack_bytes"] == 0
    # the quantizing norm and SiLU-and-mul hold their rows in registers
    for variant in ("rmsnorm + residual, fp8 out, pdl", "rmsnorm + residual, fp8 out per token",
                    "silu_mul, fp8 out, pdl", "silu_mul, fp8 out per token"):
        assert all(r["stack_bytes"] == 0 for (v, _), r in rows.items() if v == variant), variant


@pytest.mark.skipif(not _ptxas_present(), reason="needs Triton's NVIDIA backend and its ptxas")
@pytest.mark.timeout(900)
def test_fused_moe_kernels_compile_for_sm90_without_spilling(tmp_path):
    """The fused-MoE kernels on their default tiles (decode at 1 and 8 rows, grouped at 4,096; bf16, FP8 per
    channel and per block) compile for Hopper, fit its shared memory and keep everything in registers."""
    out = tmp_path / "sm90_moe.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sm90_compile.py"), "--sets", "moe",
                           "--check", "--json", str(out)], env=env, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    kernels = {r["kernel"] for r in report["rows"]}
    assert {"_route_kernel", "_moe_decode_kernel", "_count_kernel", "_scan_kernel", "_place_kernel",
            "_moe_gemm_kernel", "_moe_sum_kernel", "_quantize_rows_kernel"} <= kernels
    assert all(r["stack_bytes"] == 0 for r in report["rows"]), [r for r in report["rows"] if r["stack_bytes"]]
