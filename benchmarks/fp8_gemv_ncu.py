"""Hardware counters for the batch-1 GEMVs, FP8 and bf16, as the decode chain launches them (Nsight Compute).

The FP8 step's gap to its floor sits in the short FP8 GEMVs (`results/fp8_h200.md`), and timing variants
has not said where inside them the time goes. This script launches each one-row GEMV the engine runs at the
Qwen3-8B shape (the table's tiles, under PDL), a few times each; run under `ncu` it gives each kernel's
duration from a cold L2 (ncu flushes caches between replays, as the decode chain meets its weights), DRAM
throughput, achieved occupancy, registers and shared memory, and where its warps stall. `--sass` also
writes each kernel's SASS instruction mix (does the FP8 product run as QGMMA, how many conversions).

    ncu --clock-control none --target-processes all -k regex:gemv --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats --csv --page raw \
        python3 benchmarks/fp8_gemv_ncu.py > $OUT/ncu_raw.csv                  # H200 or H100, about a minute
    python3 benchmarks/fp8_gemv_ncu.py --summarize $OUT/ncu_raw.csv --out $OUT/ncu.json   # the table
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (label, N, K, kind): kind names the call for one row with per-channel scales. The engine's: the stream
# kernel (qkv, o_proj and gate_up on whole rows, gate_up ending in the SiLU-and-mul; down); qkv_a8x,
# gate_up_a8x and down_a8 are the tiles those ran before, which their 2-16 rows still run (the tables' 4-row
# class holds the old one-row tiles).
CASES = (("qkv_stream_fp8", 6144, 4096, "stream"), ("qkv_a8x", 6144, 4096, "a8x"),
         ("gate_up_stream_silu_fp8", 24576, 4096, "stream_silu"),
         ("gate_up_a8x", 24576, 4096, "a8x"), ("down_stream_fp8", 4096, 12288, "stream"),
         ("down_a8", 4096, 12288, "a8"),
         ("down_a8x_same_tile", 4096, 12288, "a8x_down"), ("o_stream_fp8", 4096, 4096, "stream"),
         ("qkv_stream_bf16", 6144, 4096, "bf16"), ("down_stream_bf16", 4096, 12288, "bf16"))
CALLS = 3
# Raw counters read off ncu's CSV (substring of the column name -> short name)
COUNTERS = {
    "gpu__time_duration.sum": "us",
    "dram__bytes.sum.per_second": "dram_bytes_per_s",
    "dram__cycles_active.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "launch__registers_per_thread": "regs",
    "launch__shared_mem_per_block_dynamic": "smem_dyn",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__occupancy_limit_registers": "limit_regs",
    "launch__occupancy_limit_shared_mem": "limit_smem",
}
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def launch_all() -> None:
    import torch
    from llmserve_core.kernels.fp8_format import quantize_per_channel
    from llmserve_core.kernels.fp8_gemv import DEFAULT_CONFIGS, X_AHEAD_CONFIGS, X_AHEAD_GROUP, fp8_gemv
    from llmserve_core.kernels.fp8_quant import quantize_activation
    from llmserve_core.kernels.stream_gemv import stream_gemv
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for label, n, k, kind in CASES:
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        if kind == "bf16":
            fn = lambda: stream_gemv(x, w, pdl=True)             # noqa: E731
        else:
            q, s = quantize_per_channel(w)
            xq, xs = quantize_activation(x, X_AHEAD_GROUP)
            if kind.startswith("stream"):
                fn = lambda silu=kind == "stream_silu": stream_gemv(x, q, s, pdl=True, silu_mul=silu)   # noqa: E731
            elif kind == "a8":
                cfg = dict(DEFAULT_CONFIGS[(n, k, 4, "channel")])
                fn = lambda: fp8_gemv(x, q, s, config=cfg, pdl=True)   # noqa: E731
            else:
                cfg = dict(DEFAULT_CONFIGS[(n, k, 4, "channel")] if kind == "a8x_down"
                           else X_AHEAD_CONFIGS[(n, k, 4, "channel")])
                fn = lambda: fp8_gemv(xq, q, s, config=cfg, pdl=True, x_scale=xs,   # noqa: E731
                                      x_group=X_AHEAD_GROUP, out_dtype=x.dtype)
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        print(f"launched {label} x{CALLS}", file=sys.stderr)


def sass_mix(out_dir: str) -> dict:
    """Each compiled GEMV kernel's SASS opcode counts (from Triton's cache of this process's compiles)."""
    import glob
    cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    mix = {}
    for cubin in glob.glob(os.path.join(cache, "*", "*gemv*.cubin")):
        name = os.path.basename(cubin)[:-6] + "_" + os.path.basename(os.path.dirname(cubin))[:8]
        try:
            sass = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as e:
            mix[name] = {"error": repr(e)}
            continue
        ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
        mix[name] = dict(ops.most_common(25))
        with open(os.path.join(out_dir, "sass.txt"), "a") as f:
            f.write(f"==== {name}\n{sass}")
    return mix


def summarize(path: str) -> list[dict]:
    """One row per profiled launch: the counters above and the stall reasons, largest first."""
    text = open(path).read()
    start = text.find('"ID"')
    rows = list(csv.reader(io.StringIO(text[start:])))
    header, units = rows[0], rows[1]
    body = [r for r in rows[2:] if len(r) == len(header)]
    name_col = header.index("Kernel Name")
    out = []
    for i_launch, r in enumerate(body):
        # (ncu lists the launches in order: CALLS of each case, as launch_all makes them)
        case = CASES[i_launch // CALLS][0] if i_launch < len(CASES) * CALLS else None
        rec = {"case": case, "kernel": r[name_col][:60]}
        for i, h in enumerate(header):
            short = COUNTERS.get(h)
            if short is not None:
                v = _num(r[i])
                rec[short] = v * TIME_UNITS.get(units[i], 1.0) if short == "us" and isinstance(v, float) else v
            m = STALL.fullmatch(h)
            if m and _num(r[i]):
                rec.setdefault("stalls", {})[m.group(1)] = _num(r[i])
        if "stalls" in rec:
            rec["stalls"] = dict(sorted(rec["stalls"].items(), key=lambda kv: -kv[1])[:6])
        out.append(rec)
    return out


def _num(s: str):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summarize", help="ncu --csv --page raw output to read")
    ap.add_argument("--out", help="JSON to write (with --summarize or --sass)")
    ap.add_argument("--sass", help="launch every case, then write the SASS opcode mix to this folder")
    args = ap.parse_args()
    if args.summarize:
        rows = summarize(args.summarize)
        for r in rows:
            stalls = " ".join(f"{k}={v:.2f}" for k, v in r.get("stalls", {}).items())
            print(f"{r['case'] or r['kernel'][:20]:20s} {r.get('us', 0):6.2f} us {r.get('dram_bytes_per_s', 0) / 1e12:5.2f} TB/s "
                  f"(dram busy {r.get('dram_pct', 0):4.1f}%) sm {r.get('sm_pct', 0):4.1f}% occ {r.get('occupancy_pct', 0):4.1f}% "
                  f"grid {r.get('grid')} x {r.get('block')} regs {r.get('regs')} smem {r.get('smem_dyn')} | {stalls}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TRITON_CACHE_DIR"] = cache
            launch_all()
            mix = sass_mix(args.sass)
        for name, ops in mix.items():
            print(name, ops)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(mix, f, indent=1)
        return
    launch_all()


if __name__ == "__main__":
    main()
