"""cuBLAS against cuBLASLt (torch.backends.cuda.preferred_blas_library) on the decoder's projections at
decode-batch row counts (default 16 to 256), the Qwen3-8B shapes in bf16: microseconds per F.linear inside
a CUDA graph of back-to-back calls over weight copies larger than L2 (gemv_bench.bench), and TB/s of weight.

    PYTHONPATH=$PWD python3 benchmarks/blas_library_bench.py [--rows 64,256] [--out $OUT/blas_library.json]  # H200, ~30 s
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_bench import SHAPES, bench  # noqa: E402

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="16,32,48,64,96,128,192,256")
    args = ap.parse_args()
    res = {"default": str(torch.backends.cuda.preferred_blas_library()), "device": torch.cuda.get_device_name(),
           "rows": {}}
    print("default library:", res["default"], flush=True)
    for name in PROJECTIONS:
        n, k = SHAPES[name]
        copies = max(2, -(-320 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                ms = bench(lambda i: F.linear(x, ws[i]), copies, replays=5)
                row[lib] = {"us": ms * 1e3, "tb_s": n * k * 2 / ms / 1e9}
            res["rows"][f"{name}_m{m}"] = row
            print(f"{name:8s} m{m:<4d}", " | ".join(f"{lib} {r['us']:7.1f} us {r['tb_s']:5.2f} TB/s"
                                                    for lib, r in row.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
