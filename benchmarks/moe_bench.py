"""The fused-MoE kernels alone at Qwen3-30B-A3B's shape (128 experts, top-8, hidden 2048, experts' intermediate
768), bf16 and FP8 (per-channel and 128 x 128 block scales), against their floors measured in the same run.

For each kind and row count: random routing per layer (route, the engine's kernel), a check of fused_moe
against moe_reference first, then fused_moe over `--layers` layers' distinct weights (more bytes than L2
holds) captured in one CUDA graph and replayed; route + fused_moe likewise. The floor of a layer is

    max(bytes / copy bandwidth, FLOPs / peak)

with bytes = the weights (and scales) of the distinct experts its routing selected, plus x read and the
output written, and FLOPs = 6 I H per (token, expert) pair; the copy bandwidth and the bf16 and FP8 matmul
peaks are measured on the card in the same run (benchmarks/floor.py's way). Nothing compiles inside a timed
window: every variant runs once before its graph is captured.

    python benchmarks/moe_bench.py --out $OUT/moe_bench.json                    # ~1-2 min on an H100
    python benchmarks/moe_bench.py --tune --kinds bf16 --out $OUT/tune          # tile sweep -> JSON tables
    python benchmarks/moe_bench.py --smoke --out /tmp/moe.json                  # CPU, interpreter, tiny shapes

--tune runs benchmarks/moe_tune.py's sweep (its tables land under OUT/configs/fused_moe/, to be copied into
llmserve_core/kernels/configs/fused_moe/).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from decode_layer_bench import Timer  # noqa: E402  (median of graph replays)
from floor import measure_bf16_peak, measure_copy_bandwidth  # noqa: E402
from peer_compare import commit_of  # noqa: E402
from llmserve_core.kernels.fp8_format import quantize_per_block, quantize_per_channel  # noqa: E402
from llmserve_core.kernels.fused_moe import fused_moe, moe_config, route  # noqa: E402
from llmserve_core.kernels.moe_reference import fused_moe_reference  # noqa: E402

KINDS = {"bf16": None, "fp8_channel": "channel", "fp8_block": (128, 128)}


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    inter: int


QWEN3_30B_A3B = Shape(128, 8, 2048, 768)
SMOKE = Shape(8, 2, 64, 32)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


class Layers:
    """`count` layers' expert weights of one kind (random, bf16 then quantized for the FP8 kinds)."""

    def __init__(self, s: Shape, kind: str, count: int, device, dtype):
        self.s, self.kind, self.device, self.dtype = s, kind, device, dtype
        scheme = KINDS[kind]
        self.block = scheme if isinstance(scheme, tuple) else None
        g = torch.Generator(device=device).manual_seed(0)
        self.layers = []
        for _ in range(count):
            w13 = (torch.randn(s.experts, 2 * s.inter, s.hidden, generator=g, device=device) * s.hidden ** -0.5).to(dtype)
            w2 = (torch.randn(s.experts, s.hidden, s.inter, generator=g, device=device) * s.inter ** -0.5).to(dtype)
            if scheme is None:
                self.layers.append((w13, w2, None, None))
            else:
                (q13, s13), (q2, s2) = self._quantize(w13), self._quantize(w2)
                self.layers.append((q13, q2, s13, s2))
            del w13, w2

    def _quantize(self, w):
        parts = [quantize_per_channel(m) if self.block is None else quantize_per_block(m, self.block) for m in w]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])

    def expert_bytes(self) -> int:
        """One expert's weights and scales."""
        s = self.s
        if self.kind == "bf16":
            return 3 * s.inter * s.hidden * torch.tensor([], dtype=self.dtype).element_size()
        scales = self.layers[0][2][0].numel() + self.layers[0][3][0].numel()
        return 3 * s.inter * s.hidden + 4 * scales

    def run(self, layer: int, x, weights, ids, config: dict | None = None):
        w13, w2, s13, s2 = self.layers[layer]
        return fused_moe(x, w13, w2, weights, ids, s13, s2, self.block, config=config)

    def reference(self, layer: int, x, weights, ids):
        w13, w2, s13, s2 = self.layers[layer]
        return fused_moe_reference(x, w13, w2, weights, ids, s13, s2, self.block)


def routing(s: Shape, rows: int, layers: int, device, dtype, seed: int):
    """Per layer: x, router logits and route's (weights, ids)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(layers):
        x = torch.randn(rows, s.hidden, generator=g, device=device).to(dtype)
        logits = torch.randn(rows, s.experts, generator=g, device=device).to(dtype)
        out.append((x, logits, *route(logits, s.top_k, True)))
    return out


def measure_fp8_peak(n: int = 8192) -> float | None:
    """FP8 matmul rate (torch._scaled_mm, row-wise scales) in FLOP/s, or None where it does not run."""
    from triton.testing import do_bench
    try:
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
        mm = lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        return 2 * n ** 3 / (do_bench(mm, warmup=25, rep=200, return_mode="median") / 1e3)
    except (RuntimeError, AttributeError, TypeError):
        return None


def measure_case(s: Shape, weights: Layers, rows: int, timer: Timer, rates: dict, tol: float) -> dict:
    dev, dtype, count = weights.device, weights.dtype, len(weights.layers)
    inputs = routing(s, rows, count, dev, dtype, seed=rows)
    x0, _, w0, ids0 = inputs[0]
    err = rel_err(weights.run(0, x0, w0, ids0), weights.reference(0, x0, w0, ids0))
    kernels_us = timer.us([lambda i=i, x=x, w=w, ids=ids: weights.run(i, x, w, ids)
                           for i, (x, _, w, ids) in enumerate(inputs)])
    routed_us = timer.us([lambda i=i, x=x, lg=lg: weights.run(i, x, *route(lg, s.top_k, True))
                          for i, (x, lg, _, _) in enumerate(inputs)])
    distinct = sum(torch.unique(ids).numel() for *_, ids in inputs) / count
    act_bytes = 2 * rows * s.hidden * torch.tensor([], dtype=dtype).element_size()
    layer_bytes = distinct * weights.expert_bytes() + act_bytes
    flops = 6 * rows * s.top_k * s.inter * s.hidden
    peak = rates["fp8_peak"] if weights.kind != "bf16" and rates.get("fp8_peak") else rates["bf16_peak"]
    memory_us, compute_us = layer_bytes / rates["copy_bandwidth"] * 1e6, flops / peak * 1e6
    floor_us = max(memory_us, compute_us)
    cfg = moe_config(rows, s.experts, 2 * s.inter, s.hidden, s.top_k, weights.layers[0][0].dtype, dtype,
                     weights.block, dev)
    return {"kind": weights.kind, "rows": rows, "path": cfg["path"], "config": cfg, "distinct_experts": distinct,
            "rel_err": err, "ok": err < tol, "us_per_layer": kernels_us, "with_route_us_per_layer": routed_us,
            "bytes_per_layer": layer_bytes, "flops_per_layer": flops, "floor_us": floor_us,
            "bound": "memory" if memory_us >= compute_us else "compute",
            "of_floor": floor_us / kernels_us, "tb_per_s": layer_bytes / kernels_us / 1e6,
            "tflop_per_s": flops / kernels_us / 1e6}


def report(result: dict) -> str:
    lines = [f"{'kind':<12}{'rows':>6} {'path':<8}{'experts':>8}{'us/layer':>10}{'+route':>9}{'floor':>9}"
             f"{'of floor':>9}{'TB/s':>7}{'TFLOP/s':>9}{'err':>9}"]
    for r in result["cases"]:
        lines.append(f"{r['kind']:<12}{r['rows']:>6} {r['path']:<8}{r['distinct_experts']:>8.1f}"
                     f"{r['us_per_layer']:>10.1f}{r['with_route_us_per_layer']:>9.1f}{r['floor_us']:>9.1f}"
                     f"{r['of_floor']:>8.0%}{'' if r['bound'] == 'memory' else '*':<1}{r['tb_per_s']:>6.2f}"
                     f"{r['tflop_per_s']:>9.1f}{r['rel_err']:>9.1e}")
    rates = result["meta"]["rates"]
    lines.append(f"copy {rates['copy_bandwidth'] / 1e12:.2f} TB/s, bf16 {rates['bf16_peak'] / 1e12:.0f} TFLOP/s, "
                 f"fp8 {(rates.get('fp8_peak') or 0) / 1e12:.0f} TFLOP/s; * = compute-bound floor")
    if result["skipped"]:
        lines.append(f"skipped (budget): {result['skipped']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write (with --tune: a directory)")
    ap.add_argument("--rows", default=None, help="row counts, comma-separated (default 1,8,64,256,4096; "
                    "smoke: 1,5,40)")
    ap.add_argument("--kinds", default="bf16,fp8_channel,fp8_block", help=f"of {', '.join(KINDS)}")
    ap.add_argument("--layers", type=int, default=4, help="layers of distinct weights per timed graph")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds: start no new case after this")
    ap.add_argument("--tune", action="store_true", help="run benchmarks/moe_tune.py's sweep instead")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    ap.add_argument("--commit", default=None, help="the tree's commit (default: .commit, else git)")
    args, rest = ap.parse_known_args(argv)
    args.commit = args.commit or commit_of(ROOT)
    if args.tune:
        import moe_tune
        return moe_tune.main(["--out", args.out, "--kinds", args.kinds, "--budget", str(args.budget),
                              "--layers", str(args.layers), "--commit", args.commit,
                              *(["--rows", args.rows] if args.rows else []),
                              *(["--smoke"] if args.smoke else []), *rest])
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    t_start = time.time()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    s = QWEN3_30B_A3B if not args.smoke else SMOKE
    rows_list = [int(r) for r in (args.rows or ("1,5,40" if args.smoke else "1,8,64,256,4096")).split(",")]
    layers = args.layers if cuda else 1
    if cuda:
        rates = {"copy_bandwidth": measure_copy_bandwidth(), "bf16_peak": measure_bf16_peak(),
                 "fp8_peak": measure_fp8_peak()}
    else:
        rates = {"copy_bandwidth": 1e11, "bf16_peak": 1e12, "fp8_peak": None}
    timer = Timer(cuda, reps=20)
    result = {"meta": {"gpu": torch.cuda.get_device_name() if cuda else "cpu (interpreter smoke run)",
                       "torch": torch.__version__, "python": platform.python_version(), "shape": asdict(s),
                       "layers_per_graph": layers, "rates": rates, "commit": args.commit},
              "cases": [], "skipped": []}
    for kind in args.kinds.split(","):
        if time.time() - t_start > args.budget:
            result["skipped"].append({"kind": kind})
            continue
        weights = Layers(s, kind, layers, device, dtype)
        for rows in rows_list:
            if time.time() - t_start > args.budget:
                result["skipped"].append({"kind": kind, "rows": rows})
                continue
            # W8A8 (the grouped path's FP8) rounds each row to e4m3 twice; the rest only to the model dtype.
            tol = 0.08 if kind != "bf16" else 2e-2
            result["cases"].append(measure_case(s, weights, rows, timer, rates, tol))
        del weights
        if cuda:
            torch.cuda.empty_cache()
    result["meta"]["seconds"] = time.time() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(report(result))
    ok = all(c["ok"] for c in result["cases"])
    print(f"checks: {'all passed' if ok else 'FAILED'}; {result['meta']['seconds']:.0f} s; JSON: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
