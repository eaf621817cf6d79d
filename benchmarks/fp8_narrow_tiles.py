"""One-row FP8 "a8" tiles beyond fp8_gemv_sweep.py's (BLOCK_N 16/32, BLOCK_K 256, deeper pipelines, fewer K
splits), timed under PDL as the decode chain runs them (per-channel scales, CUDA graphs over weight copies
larger than L2). A tile that beats the table's entry by 3% is patched into kernels/fp8_gemv.py's table, and
the FP8 batch-1 decode step then runs with the table as committed and as patched, twice each, in the same
call: the step is the verdict, not the kernel alone. Needs a Hopper GPU (PDL).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/fp8_narrow_tiles.py --out $OUT/fp8_narrow.json   # H200, ~30 s
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import llmserve_core.kernels.fp8_gemv as fp8_gemv_module  # noqa: E402
from llmserve_core.kernels.fp8_format import dequantize_weight, quantize_per_channel  # noqa: E402
from llmserve_core.kernels.fp8_gemv import fp8_gemv, fp8_gemv_a8_reference, fp8_gemv_config  # noqa: E402
from llmserve_core.kernels.stream_gemv import stream_gemv  # noqa: E402
from floor import measure_bf16_peak, measure_copy_bandwidth  # noqa: E402
from fp8_gemv_sweep import ROTATE_BYTES, SHAPES, split_for  # noqa: E402
from gemv_bench import launches_us  # noqa: E402
from qwen3_8b import write_qwen3_8b_dir  # noqa: E402

SMS = 132   # the table's card (kernels/fp8_gemv.py's TABLE_SMS)
# (BLOCK_N, BLOCK_K, warps, stages, programs per SM the K split aims at)
CANDIDATES = ((32, 128, 4, 4, 4), (32, 128, 4, 6, 4), (32, 256, 4, 4, 4), (32, 256, 4, 3, 8), (16, 256, 4, 4, 4),
              (16, 128, 4, 6, 4), (32, 128, 4, 8, 2), (64, 256, 4, 3, 4), (64, 128, 4, 6, 2), (16, 512, 4, 3, 4))


def one_row_call(cfg: dict):
    """(x, weight, scale) -> y in this config, under PDL; and the reference its arithmetic follows."""
    if cfg["KERNEL"] == "stream":
        return (lambda x, q, s: stream_gemv(x, q, s, None, pdl=True),
                lambda x, q, s: (x.float() @ dequantize_weight(q, s, None).t()))
    return (lambda x, q, s: fp8_gemv(x, q, s, None, config=dict(cfg), pdl=True),
            lambda x, q, s: fp8_gemv_a8_reference(x, q, s, None, group=cfg["BLOCK_K"]))


def time_shape(n: int, k: int, gen) -> dict:
    copies = max(2, -(-ROTATE_BYTES // (n * k)))
    weights = [quantize_per_channel(torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) * 0.02)
               for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    configs = {"current": fp8_gemv_config(1, n, k, None, SMS, True, stream=True)}
    for bn, bk, warps, stages, per_sm in CANDIDATES:
        split = split_for(n, k, bn, bk, SMS, per_sm)
        configs[f"a8_bn{bn}_bk{bk}_w{warps}_s{stages}_sk{split}"] = dict(
            KERNEL="a8", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)

    def call_and_reference(cfg):
        call, reference = one_row_call(cfg)
        return call, reference(x, *weights[0])
    return time_configs(configs, call_and_reference, x, weights)


def time_configs(configs: dict, call_and_reference, x, weights, tolerance: float = 2e-2) -> dict:
    """label -> {config, us, tb_s, rel_err} (or the error) for each config: call_and_reference(cfg) gives
    the (x, weight, scale) -> y call and what it must compute on weights[0] (within `tolerance`, relative);
    timed over every weight copy, twice, in one CUDA graph."""
    n, k = weights[0][0].shape
    case = {}
    for label, cfg in configs.items():
        try:
            call, ref = call_and_reference(cfg)
            ref = ref.float()
            err = ((call(x, *weights[0]).float() - ref).norm() / ref.norm()).item()
            if err > tolerance:
                case[label] = {"config": cfg, "error": f"relative error {err:.3g} against the reference"}
                continue
            us = launches_us([lambda q=q, s=s: call(x, q, s) for q, s in weights] * 2)
            case[label] = {"config": cfg, "us": us, "tb_s": n * k / us / 1e6, "rel_err": err}
        except Exception as e:       # a tile the compiler refuses is reported, not fatal
            case[label] = {"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]}
    return case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("fp8_narrow_tiles: needs a Hopper (or later) GPU: the chain's kernels launch under PDL")
    out = {"commit": args.commit, "copy_tb_s": measure_copy_bandwidth() / 1e12, "cases": {}, "engine": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    patch = {}
    for name, (n, k) in SHAPES.items():
        case = out["cases"][name] = time_shape(n, k, gen)
        timed = {label: r for label, r in case.items() if "us" in r}
        best = min(timed, key=lambda label: timed[label]["us"])
        print(f"{name:8s} table {timed['current']['tb_s']:.2f} TB/s, best {best} {timed[best]['tb_s']:.2f}", flush=True)
        if best != "current" and timed[best]["us"] < 0.97 * timed["current"]["us"]:
            patch[(n, k)] = timed[best]["config"]
        torch.cuda.empty_cache()
    out["patch"] = {f"{n}x{k}": cfg for (n, k), cfg in patch.items()}
    import decode_profile
    peak, model_dir = measure_bf16_peak(), write_qwen3_8b_dir(tempfile.mkdtemp())
    table = dict(fp8_gemv_module.DEFAULT_CONFIGS)
    for variant in ("table", "patched", "table2", "patched2"):
        fp8_gemv_module.DEFAULT_CONFIGS.clear()
        fp8_gemv_module.DEFAULT_CONFIGS.update(table)
        if variant.startswith("patched"):
            for (n, k), cfg in patch.items():
                for kind in ("channel", "block"):
                    fp8_gemv_module.DEFAULT_CONFIGS[(n, k, 1, kind)] = dict(cfg)
        r = decode_profile.run_batch(model_dir, 1, 512, measure_copy_bandwidth(), peak, 60, False, "fp8", "auto")
        out["engine"][variant] = {key: r[key] for key in ("step_ms", "floor_ms", "fraction_of_floor", "kernels_per_step")}
        print(f"fp8 batch 1, {variant:9s} step {r['step_ms']:.3f} ms ({100 * r['fraction_of_floor']:.1f}% of the floor)",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
