"""Sweep the fused-MoE kernels' tiles on a GPU and write the best per rows bucket as JSON tables
(kernels/tuned.py's fused_moe family), for llmserve_core/kernels/configs/fused_moe/.

Per kind (bf16, fp8_channel, fp8_block) and rows bucket (a power of two; each timed at the bucket's top),
fused_moe runs over `--layers` layers' weights in one CUDA graph (moe_bench's timer, routing and weights),
for: the heuristic default first, then on the decode path (up to 16 rows) its tiles, gate_up's then down's
(coordinate descent: each candidate compiles one kernel), and the fused or separate sum; on the grouped
path each row block that suits the bucket, with gate_up's then down's tiles. A candidate counts only if its
output matches the default's within the kind's tolerance. Buckets run in priority order (the bench's row
counts first) until --budget seconds are spent; untried buckets are left out of the table, where the lookup
gives them the default.

The table is written to OUT/configs/fused_moe/device=<card>.json, starting from the tree's own table for
the card, so that copying it back into llmserve_core/kernels/configs/fused_moe/ after each call (one kind
per call fits a 10-minute device call) keeps what earlier calls found.

    python benchmarks/moe_tune.py --kinds bf16 --budget 500 --out $OUT/tune
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from peer_compare import commit_of  # noqa: E402
from moe_bench import KINDS, QWEN3_30B_A3B, SMOKE, Layers, Shape, Timer, rel_err, routing  # noqa: E402
from llmserve_core.kernels import fused_moe, tuned  # noqa: E402
from llmserve_core.kernels.moe_decode import default_decode_config  # noqa: E402
from llmserve_core.kernels.moe_decode import fits as decode_fits  # noqa: E402

PRIORITY = (1, 8, 64, 256, 4096, 2, 4, 16, 32, 128, 512, 1024, 2048, 8192)


def decode_tiles(rows: int, fp8: bool, block) -> list[dict]:
    """Candidate decode tiles: one row on the CUDA cores (weight rows x columns a program, warps); more rows
    on the tensor cores (a 16-row tile), and up to 4 on the CUDA cores in a small row tile."""
    cuda_cores = [(8, 512, 4), (16, 512, 4), (16, 256, 4), (8, 1024, 4), (32, 256, 4), (16, 1024, 8),
                  (4, 1024, 4), (32, 512, 8), (32, 128, 4), (64, 128, 4)]
    dot = [(16, 128, 4), (32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 64, 4), (16, 256, 4), (128, 128, 8)]
    tiles = [dict(DOT=False, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=1) for n, k, w in cuda_cores
             if rows <= 4 and (rows == 1 or n * k <= 4096)]
    if rows > 1:
        tiles += [dict(DOT=True, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=1) for n, k, w in dot]
    return [t for t in tiles if block is None or block[1] % t["BLOCK_K"] == 0]


def grouped_tiles(fp8: bool, block) -> list[dict]:
    """Candidate grouped-GEMM tiles (BLOCK_N, BLOCK_K, GROUP_M, warps, stages)."""
    if fp8:
        raw = [(128, 128, 8, 4, 3), (128, 128, 8, 8, 3), (256, 128, 8, 8, 3), (64, 128, 8, 4, 4),
               (128, 64, 8, 4, 4), (256, 64, 8, 8, 4), (64, 128, 1, 4, 3)]
    else:
        raw = [(128, 64, 8, 4, 3), (64, 64, 8, 4, 3), (128, 64, 8, 4, 4), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3),
               (64, 128, 1, 4, 3), (128, 32, 8, 4, 4), (256, 128, 8, 8, 2)]
    tiles = [dict(BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=st) for n, k, g, w, st in raw]
    return [t for t in tiles if block is None or block[1] % t["BLOCK_K"] == 0]


def block_ms(rows: int, s: Shape, fp8_block: bool) -> list[int]:
    """Row blocks worth trying: about the rows each expert gets, the next size either side."""
    per_expert = rows * s.top_k / s.experts
    sizes = [b for b in (16, 32, 64, 128) if b / 4 <= per_expert or b == 16]
    sizes = sizes[-3:] if len(sizes) > 3 else sizes
    return [b for b in sizes if not (fp8_block and b > 64)]


class Trial:
    """Times configs for one (kind, rows) on fixed routing, against the default's output."""

    def __init__(self, weights: Layers, rows: int, timer: Timer, tol: float, deadline: float):
        self.weights, self.rows, self.timer, self.tol, self.deadline = weights, rows, timer, tol, deadline
        self.inputs = routing(weights.s, rows, len(weights.layers), weights.device, weights.dtype, seed=rows)
        x, _, w, ids = self.inputs[0]
        self.expected = weights.run(0, x, w, ids)
        self.log: list[dict] = []

    def time(self, cfg: dict) -> float:
        """us per layer, or inf where the config fails (compile, resources) or disagrees with the default."""
        if time.time() > self.deadline:
            return float("inf")
        try:
            x, _, w, ids = self.inputs[0]
            err = rel_err(self.weights.run(0, x, w, ids, cfg), self.expected)
            if err > self.tol:
                self.log.append({"config": cfg, "error": f"disagrees with the default: {err:.2e}"})
                return float("inf")
            us = self.timer.us([lambda i=i, x=x, w=w, ids=ids: self.weights.run(i, x, w, ids, cfg)
                                for i, (x, _, w, ids) in enumerate(self.inputs)])
        except Exception as exc:      # a tile that does not compile or fit: not a candidate
            self.log.append({"config": cfg, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            return float("inf")
        self.log.append({"config": cfg, "us": us})
        return us


def descend(trial: Trial, base: dict, base_us: float, tiles: list[dict]) -> tuple[dict, float]:
    """gate_up's tiles, then down's, each from the best so far."""
    best, best_us = base, base_us
    for part in ("gate_up", "down"):
        for tile in tiles:
            cfg = {**best, part: dict(tile)}
            if cfg == best:
                continue
            us = trial.time(cfg)
            if us < best_us:
                best, best_us = cfg, us
    return best, best_us


def tune_bucket(weights: Layers, rows: int, timer: Timer, tol: float, deadline: float) -> tuple[dict, dict]:
    s, block = weights.s, weights.block
    weight_bytes = 2 if weights.kind == "bf16" else 1
    trial = Trial(weights, rows, timer, tol, deadline)
    default = fused_moe.default_config(rows, s.experts, weight_bytes, block, s.top_k)
    default_us = trial.time(default)
    best, best_us = default, default_us
    starts = []
    if decode_fits(rows, s.top_k):
        starts.append((default_decode_config(rows, weight_bytes, block),
                       decode_tiles(rows, weight_bytes == 1, block)))
    for block_m in block_ms(rows, s, block is not None) if rows > 1 else []:
        tiles = grouped_tiles(weight_bytes == 1, block)
        starts.append(({"path": "grouped", "BLOCK_M": block_m, "gate_up": dict(tiles[0]), "down": dict(tiles[0])},
                       tiles))
    for base, tiles in starts:
        cfg, us = descend(trial, base, default_us if base == default else trial.time(base), tiles)
        if us < best_us:
            best, best_us = cfg, us
    if best["path"] == "decode":
        flipped = {**best, "FUSED_SUM": not best.get("FUSED_SUM", False)}
        us = trial.time(flipped)
        if us < best_us:
            best, best_us = flipped, us
    return best, {"rows": rows, "best_us": best_us, "default_us": default_us, "best": best,
                  "tried": len(trial.log), "log": trial.log}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory: configs/fused_moe/*.json and tune_<kind>.json")
    ap.add_argument("--kinds", default="bf16", help=f"of {', '.join(KINDS)}, comma-separated")
    ap.add_argument("--rows", default=None, help="rows buckets in the order to tune (default: "
                    f"{','.join(map(str, PRIORITY))}; smoke: 1,8)")
    ap.add_argument("--layers", type=int, default=4, help="layers of distinct weights per timed graph")
    ap.add_argument("--budget", type=float, default=500.0, help="seconds for the whole sweep")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    ap.add_argument("--commit", default=None, help="the tree's commit (default: .commit, else git)")
    args = ap.parse_args(argv)
    args.commit = args.commit or commit_of(ROOT)
    t_start = time.time()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    s = QWEN3_30B_A3B if not args.smoke else SMOKE
    kinds = args.kinds.split(",")
    rows = args.rows or ("1,8" if args.smoke else ",".join(map(str, PRIORITY)))
    buckets = list(dict.fromkeys(fused_moe.rows_bucket(int(r)) for r in rows.split(",")))
    timer = Timer(cuda, reps=10)
    summary = []
    for n, kind in enumerate(kinds):
        kind_deadline = t_start + args.budget * (n + 1) / len(kinds)
        weights = Layers(s, kind, args.layers if cuda else 1, device, dtype)
        entries, report = {}, []
        for i, rows in enumerate(buckets):
            left = kind_deadline - time.time()
            if left <= 0:
                report.append({"rows": rows, "skipped": "budget"})
                continue
            tol = 0.08 if kind != "bf16" else 2e-2
            best, info = tune_bucket(weights, rows, timer, tol, time.time() + left / (len(buckets) - i))
            if info["best_us"] < float("inf"):
                entries[rows] = best
            report.append(info)
            print(f"{kind:<12}{rows:>6} rows: default {info['default_us']:9.1f} us, best {info['best_us']:9.1f} us "
                  f"({best['path']}, {info['tried']} tried)", flush=True)
        table_dtype = fused_moe.dtype_key(weights.layers[0][0].dtype, weights.block)
        shapes = [(dict(E=s.experts, N=2 * s.inter, K=s.hidden, rows=rows, dtype=table_dtype), cfg)
                  for rows, cfg in entries.items()]
        card = tuned.device_spec(device).name
        out_dir = Path(args.out) / "configs"
        seed = tuned.config_path("fused_moe", card)
        if seed.is_file() and not tuned.config_path("fused_moe", card, out_dir).is_file():
            tuned.config_path("fused_moe", card, out_dir).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(seed, tuned.config_path("fused_moe", card, out_dir))   # the tree's entries for this card, kept
        path = tuned.write_configs("fused_moe", card, shapes,
                                   f"benchmarks/moe_tune.py --kinds {kind} --layers {args.layers} at {args.commit}",
                                   out_dir)
        with open(os.path.join(args.out, f"tune_{kind}.json"), "w") as f:
            json.dump(report, f, indent=1)
        summary.append((kind, path, sorted(entries)))
        del weights
        if cuda:
            torch.cuda.empty_cache()
    for kind, path, rows in summary:
        print(f"{kind}: {len(rows)} buckets {rows} -> {path}")
    print(f"{time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
