"""Tile configs of the fused-MoE kernels, kept as data.

One JSON table per card, kernels/configs/fused_moe/device=<card>.json (`device=NVIDIA_H100_80GB_HBM3.json`),
in the layout of the project's other kernel tables (kernel, device, keys, sources, configs), written by
benchmarks/moe_tune.py through `write_table`. An entry's shape key names the expert count, the gate_up
weight [N = 2I, K = H], the rows bucket (a power of two: rows=64 serves 33..64 rows) and the weights'
dtype (bf16, fp16, fp32, fp8_w8a8 for per-channel scales, fp8_w8a8_128x128 for block scales):

    "E=128,N=1536,K=2048,rows=1,dtype=bf16": {"path": "decode", "FUSED_SUM": true,
        "gate_up": {"DOT": false, "BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}, "down": {...}}
    "E=128,N=1536,K=2048,rows=4096,dtype=bf16": {"path": "grouped", "BLOCK_M": 64,
        "gate_up": {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}, "down": {...}}

A card, shape or bucket the table does not name, and an entry that does not fit the call (a decode entry
past what moe_decode.fits, a K tile that straddles a scale block), gets the heuristic default: never an
error. Every choice depends on the rows bucket only, never the exact row count, so one call per bucket
compiles every variant (fused_moe.warmup_row_counts).
"""
from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from pathlib import Path

import torch
import triton

from llmserve_core.kernels.fp8_format import FP8
from llmserve_core.kernels.moe_decode import default_decode_config
from llmserve_core.kernels.moe_decode import fits as decode_fits

log = logging.getLogger("llmserve.kernels")

CONFIG_DIR = Path(__file__).parent / "configs" / "fused_moe"
KEYS = ("E", "N", "K", "rows", "dtype")
DECODE_ROWS = 8          # the heuristic's decode path: up to this many rows; a table may take it to moe_decode.MAX_ROWS
DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
GROUPED_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
DECODE_KEYS = ("DOT", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def dtype_key(weight_dtype: torch.dtype, block: tuple[int, int] | None) -> str:
    """The table's dtype field: bf16 / fp16 / fp32, fp8_w8a8 (per-channel scales), fp8_w8a8_128x128 (blocks)."""
    if weight_dtype == FP8:
        return "fp8_w8a8" if block is None else f"fp8_w8a8_{block[0]}x{block[1]}"
    return DTYPE_KEYS[weight_dtype]


def device_name(name: str) -> str:
    """A card's name as the tables' file names spell it: each run of characters other than letters, digits,
    '.' and '-' one '_' ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3")."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_")


def device_key(device: torch.device) -> str:
    """The table name of a torch device: 'cpu' off CUDA."""
    return device_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"


def table_path(device: str, directory: Path | None = None) -> Path:
    return Path(directory or CONFIG_DIR) / f"device={device_name(device)}.json"


def shape_key(num_experts: int, n: int, k: int, bucket: int, dtype: str) -> str:
    return f"E={num_experts},N={n},K={k},rows={bucket},dtype={dtype}"


@lru_cache(maxsize=None)
def load_table(path: Path) -> dict[str, dict] | None:
    """A table's configs by shape key, or None where there is no file (or it cannot be read: logged)."""
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text())
        if tuple(table["keys"]) != KEYS:
            raise ValueError(f"keyed by {table['keys']}, not {list(KEYS)}")
        return {key: dict(entry) for key, entry in table["configs"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("fused_moe: ignoring the unreadable tile table %s (%s)", path, exc)
        return None


def write_table(device: str, entries: dict[str, dict], source: str, directory: Path | None = None) -> Path:
    """Merge entries (shape key -> config) into the card's table under `directory` (default CONFIG_DIR), one
    entry a line, sorted; `source` (the command or result file that measured them) joins its sources."""
    path = table_path(device, directory)
    old = json.loads(path.read_text()) if path.is_file() else {}
    configs = {**old.get("configs", {}), **entries}
    sources = [*old.get("sources", []), *([source] if source not in old.get("sources", []) else [])]
    head = {"kernel": "fused_moe", "device": device_name(device), "keys": list(KEYS), "sources": sources}
    lines = [f"    {json.dumps(key)}: {json.dumps(configs[key])}" for key in sorted(configs, key=_key_order)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in head.items())
                    + '  "configs": {\n' + ",\n".join(lines) + "\n  }\n}\n")
    load_table.cache_clear()
    _config.cache_clear()
    return path


def _key_order(key: str) -> tuple:
    """Shape keys field by field, numbers as numbers."""
    return tuple((0, int(v), "") if v.isdigit() else (1, 0, v) for v in (f.split("=", 1)[1] for f in key.split(",")))


def rows_bucket(rows: int) -> int:
    return triton.next_power_of_2(max(1, rows))


def default_config(bucket: int, num_experts: int, top_k: int, weight_bytes: int,
                   block: tuple[int, int] | None) -> dict:
    """The heuristic for a rows bucket: the decode path up to DECODE_ROWS rows; past it the grouped GEMM in
    row blocks sized to the rows each expert gets on average (16 to 64: FP8 block scales spill at 128),
    with vLLM's style of tiles (untuned here). Block scales keep a scaled partial product beside the
    accumulator: a 64 x 128 tile took 248 registers over 4 warps on sm_90, so they get 8."""
    if bucket <= DECODE_ROWS and decode_fits(bucket, top_k):
        return default_decode_config(bucket, weight_bytes, block)
    per_expert = bucket * top_k / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    tile = dict(BLOCK_N=64 if block_m == 16 else 128, BLOCK_K=64 if weight_bytes >= 2 else 128,
                GROUP_M=1 if block_m == 16 else 8, num_warps=4, num_stages=3)
    if block is not None:
        tile["BLOCK_K"] = min(tile["BLOCK_K"], block[1])
        tile["num_warps"] = 8 if block_m >= 64 else 4
    return {"path": "grouped", "BLOCK_M": block_m, "gate_up": dict(tile), "down": dict(tile)}


def usable(cfg: dict, rows: int, top_k: int, block: tuple[int, int] | None) -> bool:
    """Whether a table entry fits a call of `rows` rows: a known path with every tile key, a decode entry
    only where moe_decode.fits, even column tiles (gate_up pairs gate and up rows), K tiles inside a
    scale block."""
    try:
        keys = DECODE_KEYS if cfg["path"] == "decode" else GROUPED_KEYS
        if cfg["path"] not in ("decode", "grouped") or (cfg["path"] == "decode" and not decode_fits(rows, top_k)):
            return False
        if cfg["path"] == "grouped" and cfg["BLOCK_M"] not in (16, 32, 64, 128):
            return False
        for part in (cfg["gate_up"], cfg["down"]):
            if any(key not in part for key in keys) or part["BLOCK_N"] % 2:
                return False
            if block is not None and block[1] % part["BLOCK_K"]:
                return False
        return True
    except (KeyError, TypeError):
        return False


def fit_to_device(cfg: dict, a_bytes: int, w_bytes: int, smem_limit: int) -> dict:
    """A grouped config with fewer pipeline stages (down to 1) where its operand tiles would overfill the
    card's shared memory per block (a bf16 table entry's tiles, used for float32)."""
    if cfg["path"] != "grouped":
        return cfg
    cfg = {**cfg, "gate_up": dict(cfg["gate_up"]), "down": dict(cfg["down"])}
    for part in (cfg["gate_up"], cfg["down"]):
        per_stage = part["BLOCK_K"] * (cfg["BLOCK_M"] * a_bytes + part["BLOCK_N"] * w_bytes)
        while part["num_stages"] > 1 and part["num_stages"] * per_stage > smem_limit:
            part["num_stages"] -= 1
    return cfg


def moe_config(rows: int, num_experts: int, n: int, k: int, top_k: int, weight_dtype: torch.dtype,
               act_dtype: torch.dtype, block: tuple[int, int] | None, device: torch.device) -> dict:
    """The tiles for a fused_moe call of `rows` rows: the card's table entry for the rows bucket if it has a
    usable one, else the heuristic default; fitted to the card."""
    return dict(_config(rows_bucket(rows), num_experts, n, k, top_k, weight_dtype, act_dtype, block, device))


@lru_cache(maxsize=None)
def _config(bucket: int, num_experts: int, n: int, k: int, top_k: int, weight_dtype: torch.dtype,
            act_dtype: torch.dtype, block: tuple[int, int] | None, device: torch.device) -> dict:
    table = load_table(table_path(device_key(device))) or {}
    cfg = table.get(shape_key(num_experts, n, k, bucket, dtype_key(weight_dtype, block)))
    if cfg is not None:
        if not usable(cfg, bucket, top_k, block):
            log.warning("fused_moe: the table entry for %d rows does not fit (%s); using the default", bucket, cfg)
            cfg = None
    weight_bytes = torch.tensor([], dtype=weight_dtype).element_size()
    cfg = cfg or default_config(bucket, num_experts, top_k, weight_bytes, block)
    if device.type != "cuda":
        return cfg
    from llmserve_core.kernels.tiling import device_smem_limit
    a_bytes = 1 if weight_dtype == FP8 else torch.tensor([], dtype=act_dtype).element_size()
    return fit_to_device(cfg, a_bytes, weight_bytes, device_smem_limit(device))
