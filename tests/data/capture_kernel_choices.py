"""Capture what the per-shape selector functions answer on the tables' cards (the H100 and the H200: 132
multiprocessors, 232,448 bytes of shared memory a block, FP8 products) at Qwen3-8B's shapes, its
tensor-parallel shards and its EAGLE-3 draft's, for every row count they take; write the answers as test data
(tests/data/kernel_choices_132sm.json) and the tuned tables as kernels/configs/ JSON.

Runs against the tree that still has the selectors (gemv.default_config, projection_config, fp8_gemv's
DEFAULT_CONFIGS / X_AHEAD_CONFIGS, stream_gemv_config, tiling.prefill_config, Linear.cublaslt_max_rows):

    PYTHONPATH=$PWD python tests/data/capture_kernel_choices.py
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

import llmserve_core.kernels  # noqa: F401
from llmserve_core.kernels import fp8_gemv, gemv, stream_gemv, tiling, tuned
from llmserve_core.layers.linear import Linear

DEVICES = {"NVIDIA H100 80GB HBM3": "measured on the H100", "NVIDIA H200": "measured on the H200"}
SMS, SMEM = 132, 232_448
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QWEN3_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# tensor-parallel shards (2, 4, 8 ranks) of the same, and the EAGLE-3 draft's qkv over two hidden widths
SHARDS = [(3072, 4096), (1536, 4096), (768, 4096), (4096, 2048), (4096, 1024), (4096, 512), (12288, 4096),
          (6144, 4096), (3072, 4096), (4096, 6144), (4096, 3072), (4096, 1536), (6144, 8192)]
PROJECTIONS = sorted(set(QWEN3_8B.values()) | set(SHARDS))
LM_HEADS = [(151936, 4096), (75968, 4096), (37984, 4096), (18992, 4096), (32000, 4096)]
BLOCKS = {"channel": None, "128x128": (128, 128)}
OUT = Path(__file__).with_name("kernel_choices_132sm.json")


def ranges(answers: dict[int, object]) -> list[list]:
    """{rows: answer} -> [[first, last, answer], ...] over runs of equal answers."""
    out = []
    for rows in sorted(answers):
        if out and out[-1][1] == rows - 1 and out[-1][2] == answers[rows]:
            out[-1][1] = rows
        else:
            out.append([rows, rows, answers[rows]])
    return out


def fp8_answer(cfg: dict | None, n: int, k: int, block) -> dict | None:
    if cfg is None:
        return None
    cfg = dict(cfg)
    kernel = cfg.pop("KERNEL")
    if kernel == "stream":
        cfg = stream_gemv.stream_gemv_config(n, k, sms=SMS, weight_bytes=1, block_scaled=block is not None)
    return {"kernel": kernel, "tile": cfg}


def capture() -> dict:
    out = {"cards": list(DEVICES), "sms": SMS, "smem": SMEM, "capability": [9, 0],
           "gemv": [], "projection": [], "fp8": [], "fp8_default": [], "stream": [], "prefill": [], "cublaslt": []}
    for dname, dtype in DTYPES.items():
        size = dtype.itemsize
        for n, k in PROJECTIONS + LM_HEADS:
            tiles = {m: tiling.fit_gemv_config(gemv.default_config(gemv.row_tile(m), n, k, SMS), size, size, SMEM)
                     for m in range(1, 65)}
            out["gemv"] += [[n, k, dname, *r] for r in ranges(tiles)]
            proj = {}
            for m in range(1, 65):
                cfg = gemv.projection_config(m, n, k, SMS) if 1 < m else None
                proj[m] = None if cfg is None else tiling.fit_gemv_config(cfg, size, size, SMEM)
            out["projection"] += [[n, k, dname, *r] for r in ranges(proj)]
            out["cublaslt"].append([n, k, dname, Linear(k, n).cublaslt_max_rows()])
            cfg = stream_gemv.stream_gemv_config(n, k, sms=SMS, weight_bytes=size)
            out["stream"].append([n, k, dname, "none", cfg])
    for n, k in PROJECTIONS:
        for scale, block in BLOCKS.items():
            out["stream"].append([n, k, "fp8", scale, stream_gemv.stream_gemv_config(
                n, k, sms=SMS, weight_bytes=1, block_scaled=block is not None)])
            for stream in (False, True):
                raw = {}
                for m in range(1, 65):
                    if m <= 16:
                        cfg = fp8_gemv.fp8_gemv_config(m, n, k, block, SMS, True, stream=stream and m == 1)
                    else:
                        cfg = fp8_gemv.measured_config(m, n, k, block, SMS, True)
                    raw[m] = fp8_answer(cfg, n, k, block)
                out["fp8"] += [[n, k, scale, "raw", stream, *r] for r in ranges(raw)]
            ahead = {m: fp8_answer(fp8_gemv.x_ahead_config(m, n, k, block, SMS, True), n, k, block)
                     for m in range(1, 65)}
            out["fp8"] += [[n, k, scale, "fp8", None, *r] for r in ranges(ahead)]   # (the stream kernel takes no x quantized ahead)
            default = {m: fp8_answer(fp8_gemv.fp8_gemv_config(m, n, k, block, SMS, True), n, k, block)
                       for m in range(1, 65)}
            out["fp8_default"] += [[n, k, scale, *r] for r in ranges(default)]
    for dname, dtype in DTYPES.items():
        for head_dim in (64, 96, 128, 256):
            for query, short in (("long", False), ("short", True)):
                tile = tiling.prefill_config(1 << (head_dim - 1).bit_length(), dtype.itemsize, short, SMEM)
                out["prefill"].append([head_dim, dname, query, {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n,
                                                               "num_warps": tile.num_warps,
                                                               "num_stages": tile.num_stages}])
    return out


def write_tables(choices: dict) -> None:
    """The tuned part of the selectors' answers as kernels/configs/ tables, for each card."""
    gemv_entries = [({"N": n, "K": k, "rows": tile, "dtype": d}, cfg)
                    for (n, k, tile), cfg in gemv.MEASURED_CONFIGS.items() for d in DTYPES]
    fp8_entries = []
    for table, x in ((fp8_gemv.DEFAULT_CONFIGS, "raw"), (fp8_gemv.X_AHEAD_CONFIGS, "fp8")):
        for (n, k, rows, kind), cfg in table.items():
            order = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
            cfg = {key: cfg[key] for key in sorted(cfg, key=lambda key: (order + (key,)).index(key))}
            kernel = cfg.pop("KERNEL")
            fp8_entries.append(({"N": n, "K": k, "rows": rows, "scale": "channel" if kind == "channel" else "128x128",
                                 "x": x}, {"kernel": kernel, **({"tile": cfg} if kernel != "stream" else {})}))
    stream_entries = [({"N": n, "K": k, "dtype": d, "scale": scale}, cfg) for n, k, d, scale, cfg in choices["stream"]
                      if (n, k) in QWEN3_8B.values() and d in ("bf16", "fp8")]
    prefill_entries = [({"head_dim": hd, "dtype": d, "query": q}, cfg) for hd, d, q, cfg in choices["prefill"]
                       if hd == 128 and d == "bf16"]
    blas_entries = [({"N": n, "K": k, "dtype": "bf16"}, {"max_rows": Linear(k, n).cublaslt_max_rows()})
                    for n, k in (QWEN3_8B["o_proj"], QWEN3_8B["down"])]
    tables = {
        "gemv": (("N", "K", "rows", "dtype"), gemv_entries,
                 "benchmarks/skinny_gemm_bench.py on the H200 (results/skinny_gemm_h200.md): the projections where "
                 "the kernel beat cuBLAS in a decode layer under PDL, the lm_head's 64-row tile; fp16 and fp32 "
                 "carry the bf16 tiles, fitted to shared memory at launch"),
        "fp8_gemv": (("N", "K", "rows", "scale", "x"), fp8_entries,
                     "benchmarks/fp8_gemv_sweep.py --a8 / --a8x on the H200 (results/fp8_a8_sweep_h200_f3f7a22.json, "
                     "fp8_a8x_sweep_h200_0395de5.json), fp8_skinny_gemm.py on the H100 for 17-64 rows "
                     "(results/fp8_rows17_64_h100.md), the one-row stream choices in whole batch-1 steps on the H100 "
                     "(results/fp8_whole_rows_h100.md, fp8_fold_silu_h100.md)"),
        "stream_gemv": (("N", "K", "dtype", "scale"), stream_entries,
                        "benchmarks/fp8_gemv_sweep.py --stream on the H100 (results/stream_depth_h100.md, "
                        "fp8_whole_rows_h100.md, fp8_down_pieces_h100.md)"),
        "paged_prefill": (("head_dim", "dtype", "query"), prefill_entries,
                          "benchmarks/kernels_bench.py on the H200 (results/kernels_h200_run1.md)"),
        "cublaslt": (("N", "K", "dtype"), blas_entries,
                     "cuBLASLt against cuBLAS on the H200 (results/blas_library_h200.md)"),
    }
    for kernel, (keys, entries, source) in tables.items():
        for device in DEVICES:
            note = "" if device == "NVIDIA H200" or kernel in ("fp8_gemv", "stream_gemv") else \
                "; the H100, with the H200's 132 multiprocessors, has run the same since"
            tuned.write_configs(kernel, device, entries, source + note, keys=keys)


def indexed(choices: dict) -> dict:
    """Each row's answer (its last field) as an index into one list of the distinct answers: the file stays small."""
    answers, out = [], {}
    for key, value in choices.items():
        if isinstance(value, list) and value and isinstance(value[0], list):
            rows = []
            for row in value:
                if row[-1] not in answers:
                    answers.append(row[-1])
                rows.append(row[:-1] + [answers.index(row[-1])])
            value = rows
        out[key] = value
    return {**out, "answers": answers}


def main() -> None:
    choices = capture()
    data = indexed(choices)
    OUT.write_text("{\n" + ",\n".join(f" {json.dumps(key)}: " + (
        "[\n  " + ",\n  ".join(json.dumps(row) for row in value) + "\n ]" if isinstance(value, list) and value
        and isinstance(value[0], (list, dict)) else json.dumps(value)) for key, value in data.items()) + "\n}\n")
    write_tables(choices)
    print(f"{OUT}: " + ", ".join(f"{len(v)} {k}" for k, v in choices.items() if isinstance(v, list)))


if __name__ == "__main__":
    main()
