"""The decoder's projections at one row: cuBLAS against kernels.stream_gemv, alone and chained under PDL.

Three parts, on the H200 at the Qwen3-8B shape (bf16, and FP8 weights with per-row scales):
  shapes  each projection alone at one row, GRAPH_CALLS back-to-back calls in one CUDA graph over
          weight copies larger than L2: cuBLAS, the stream kernel's tile sweep, and the best tile under
          PDL (each call then overlaps the one before); FP8 against the current fp8_gemv.
  chain   a decoder layer without its attention, LAYERS distinct layers in one graph: add + RMSNorm, qkv,
          o_proj (reading the q slice), add + RMSNorm, gate_up, SiLU-and-mul, down, as
          cublas (today's kernels), stream (the new GEMV, plain launches), stream+pdl (every kernel of
          the chain under PDL), fp8 stream+pdl.
Every kernel is checked against its torch reference first. Prints a table last; --out writes the JSON.

    python benchmarks/pdl_chain_bench.py --out $OUT/pdl_chain.json
    python benchmarks/pdl_chain_bench.py --smoke        # tiny shapes, CPU interpreter, no PDL: checks only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
if "--smoke" in sys.argv[1:]:     # a smoke run is the CPU interpreter's, on a machine with a GPU too
    os.environ["TRITON_INTERPRET"] = "1"

from gemv_bench import SHAPES, bench, copy_bandwidth, graph_us  # noqa: E402
from llmserve_core.kernels.fp8_format import quantize_per_channel  # noqa: E402
from llmserve_core.kernels.fp8_gemv import fp8_gemv  # noqa: E402
from llmserve_core.kernels.rmsnorm import rmsnorm, rmsnorm_reference  # noqa: E402
from llmserve_core.kernels.silu_mul import silu_mul, silu_mul_reference  # noqa: E402
from llmserve_core.kernels import tuned  # noqa: E402
from llmserve_core.kernels.stream_gemv import stream_gemv, stream_gemv_reference, stream_tiles  # noqa: E402

LAYERS = 8
EPS = 1e-6
# What main() runs on: the GPU at the 8B shapes, or (--smoke) the CPU interpreter at tiny ones without PDL
# (one swept shape, whose K the sweep's tiles divide; a 64-wide layer for the chain).
RUN = {"dev": "cuda", "dt": torch.bfloat16, "shapes": SHAPES, "swept": ("qkv", "o_proj", "gate_up", "down"),
       "pdl": True, "layers": LAYERS, "copies": None}
SMOKE = dict(dev="cpu", dt=torch.float32, shapes={"qkv": (96, 64), "o_proj": (64, 64), "gate_up": (128, 64),
             "down": (64, 64), "swept": (64, 256)}, swept=("swept",), pdl=False, layers=1, copies=1)


def rel_err(y, ref) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def tile_sweep(n: int, k: int):
    for bn, bk, warps in ((4, 1024, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (8, 512, 8), (8, 1024, 8)):
        if k % bk == 0:
            yield dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1)


def sweep(name: str, x, weights: list, scales: list | None, copies: int) -> tuple[dict, list]:
    """Every tile of tile_sweep, checked against the reference, then timed: (best tile, [(tile, us)])."""
    n, k = weights[0].shape
    scale = (lambda i: scales[i]) if scales else (lambda i: None)
    timings = []
    for cfg in tile_sweep(n, k):
        try:
            err = rel_err(stream_gemv(x, weights[0], scale(0), config=cfg),
                          stream_gemv_reference(x, weights[0], scale(0)))
            us = 1e3 * bench(lambda i: stream_gemv(x, weights[i], scale(i), config=cfg), copies, replays=5)
        except Exception as e:      # a tile the compiler rejects
            print(f"  skip {name} {cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        assert err < 1e-2, f"{name} {cfg}: rel err {err}"
        timings.append((cfg, us))
    return min(timings, key=lambda t: t[1])[0], timings


def shapes_part() -> dict:
    out = {}
    dev, dt, pdl = RUN["dev"], RUN["dt"], RUN["pdl"]
    for name in RUN["swept"]:
        n, k = RUN["shapes"][name]
        copies = RUN["copies"] or max(3, -(-256 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(copies)]
        qs, ss = zip(*(quantize_per_channel(w) for w in ws))
        x = torch.randn(1, k, device=dev, dtype=dt)
        row = {"cublas_us": 1e3 * bench(lambda i: F.linear(x, ws[i]), copies)}
        best, row["sweep_us"] = sweep(name, x, ws, None, copies)
        row["stream_config"], row["stream_us"] = best, min(us for _, us in row["sweep_us"])
        row["stream_pdl_us"] = 1e3 * bench(lambda i: stream_gemv(x, ws[i], pdl=pdl, config=best), copies)
        row["default_config"] = dict(stream_tiles(tuned.device_spec(x.device), n, k, dt))
        row["default_pdl_us"] = 1e3 * bench(lambda i: stream_gemv(x, ws[i], pdl=pdl), copies)
        # FP8 weights (per-channel scales): the tensor-core FP8 GEMV against the stream kernel's own sweep
        row["fp8_gemv_us"] = 1e3 * bench(lambda i: fp8_gemv(x, qs[i], ss[i]), copies)
        best8, row["fp8_sweep_us"] = sweep(f"fp8 {name}", x, qs, ss, copies)
        row["fp8_stream_config"], row["fp8_stream_us"] = best8, min(us for _, us in row["fp8_sweep_us"])
        row["fp8_stream_pdl_us"] = 1e3 * bench(lambda i: stream_gemv(x, qs[i], ss[i], pdl=pdl, config=best8), copies)
        for key in ("cublas_us", "stream_us", "stream_pdl_us", "default_pdl_us"):
            row[key.replace("_us", "_tb_s")] = n * k * 2 / (row[key] * 1e-6) / 1e12
        for key in ("fp8_gemv_us", "fp8_stream_us", "fp8_stream_pdl_us"):
            row[key.replace("_us", "_tb_s")] = n * k / (row[key] * 1e-6) / 1e12
        out[f"{name}_m1"] = row
        print(f"{name:8s} " + " ".join(f"{a}={b:.3g}" for a, b in row.items() if isinstance(b, float)),
              best, best8, flush=True)
    return out


def layer_chain(hidden: torch.Tensor, layers: list[dict], lin, pdl: bool = False, reference: bool = False):
    """Decoder layers without their attention, one after another: add + RMSNorm, qkv, o_proj (reading the q
    slice), add + RMSNorm, gate_up, SiLU-and-mul, down. lin(x, layer, name) runs a projection; each layer
    holds its norm weights "n1", "n2"; reference: the torch norm and activation."""
    h = hidden.shape[1]
    residual = torch.zeros_like(hidden)
    for layer in layers:
        if reference:
            x, residual = rmsnorm_reference(hidden, layer["n1"], EPS, residual)
        else:
            x, residual = rmsnorm(hidden, layer["n1"], EPS, residual, pdl=pdl)
        qkv = lin(x, layer, "qkv")
        o = lin(qkv[:, :h], layer, "o_proj")
        if reference:
            x, residual = rmsnorm_reference(o, layer["n2"], EPS, residual)
            act = silu_mul_reference(lin(x, layer, "gate_up"))
        else:
            x, residual = rmsnorm(o, layer["n2"], EPS, residual, pdl=pdl)
            act = silu_mul(lin(x, layer, "gate_up"), pdl=pdl)
        hidden = lin(act, layer, "down")
    return hidden


def chain_part() -> dict:
    """LAYERS decoder layers without attention in one graph; microseconds per layer."""
    dev, dt, shapes = RUN["dev"], RUN["dt"], RUN["shapes"]
    h = shapes["o_proj"][0]
    layers = []
    for _ in range(RUN["layers"]):
        ws = {name: torch.randn(*shapes[name], device=dev, dtype=dt) * shapes[name][1] ** -0.5
              for name in ("qkv", "o_proj", "gate_up", "down")}
        layers.append({"w": ws, "q": {k: quantize_per_channel(v) for k, v in ws.items()},
                       "n1": torch.rand(h, device=dev, dtype=dt) + 0.5, "n2": torch.rand(h, device=dev, dtype=dt) + 0.5})
    hidden0 = torch.randn(1, h, device=dev, dtype=dt)

    def run(kind: str):
        pdl = kind.endswith("pdl") and RUN["pdl"]
        fp8 = kind.startswith("fp8")

        def lin(x, layer, name):
            if kind == "cublas":
                return F.linear(x, layer["w"][name])
            if kind == "reference":
                return stream_gemv_reference(x, layer["w"][name])
            if fp8:     # the default tiles, as the engine runs them
                w, s = layer["q"][name]
                return stream_gemv(x, w, s, pdl=pdl)
            return stream_gemv(x, layer["w"][name], pdl=pdl)

        return layer_chain(hidden0, layers, lin, pdl=pdl, reference=kind == "reference")

    ref = run("reference")
    row = {}
    for kind in ("cublas", "stream", "stream_pdl", "fp8_stream", "fp8_stream_pdl"):
        if kind.endswith("pdl") and not RUN["pdl"]:
            continue
        eager = run(kind)
        row[f"{kind}_us_per_layer"], captured = graph_us(lambda: run(kind), RUN["layers"])
        if not kind.startswith("fp8"):
            row[f"{kind}_rel_err"] = rel_err(eager, ref)
            assert row[f"{kind}_rel_err"] < 5e-2, (kind, row[f"{kind}_rel_err"])
        assert rel_err(captured, eager) < 1e-3, f"{kind}: graph replay differs from eager"
    print("chain, one row: " + " ".join(f"{a}={b:.4g}" for a, b in row.items()), flush=True)
    return {"m1": row}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter, no PDL (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        RUN.update(SMOKE)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    res = {"copy_bandwidth_tb_s": bw / 1e12, "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()}
    res["shapes"] = shapes_part()
    res["chain"] = chain_part()
    print("\n| shape | rows | cuBLAS TB/s | stream (best tile) | stream+PDL | default tile+PDL | fp8_gemv | fp8 stream | fp8 stream+PDL |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in res["shapes"].items():
        name, m = key.rsplit("_m", 1)
        print(f"| {name} | {m} | {r['cublas_tb_s']:.2f} | {r['stream_tb_s']:.2f} | {r['stream_pdl_tb_s']:.2f} | "
              f"{r['default_pdl_tb_s']:.2f} | "
              f"{r['fp8_gemv_tb_s']:.2f} | {r['fp8_stream_tb_s']:.2f} | {r['fp8_stream_pdl_tb_s']:.2f} |")
    print("\n| rows | cublas us/layer | stream | stream+PDL | fp8 stream | fp8 stream+PDL |")
    print("|---|---|---|---|---|---|")
    for key, r in res["chain"].items():
        print(f"| {key[1:]} | {r['cublas_us_per_layer']:.1f} | {r['stream_us_per_layer']:.1f} | "
              f"{r.get('stream_pdl_us_per_layer', float('nan')):.1f} | {r['fp8_stream_us_per_layer']:.1f} | "
              f"{r.get('fp8_stream_pdl_us_per_layer', float('nan')):.1f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
