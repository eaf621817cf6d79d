"""Tile sizes and pipeline depth for the attention kernels and the skinny GEMV, from dtype, head_dim and the
device's shared memory.

Triton keeps num_stages copies of each K and V tile in shared memory to overlap loads with math, so a
config measured best in bf16 at head_dim 128 can ask for more than the chip has in float32 or at head_dim
256 (128 x 128 tiles, 2 stages, float32, head_dim 128: 262,144 bytes against the H200's 232,448). Each
kernel lists its configs best first; the first one whose estimate fits the device's opt-in shared memory
per block is taken. The estimate counts the pipelined K/V tiles and the Q and P operands: more than Triton
was seen to allocate (it reported exactly the K/V tiles for the float32 config above), so what it accepts
has room to spare. The GPU sweep (tests/test_gpu_dtypes.py) runs every dtype and head size it picks for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve_core.kernels import tuned


@dataclass(frozen=True)
class TileConfig:
    block_m: int        # query rows per program (decode: the padded query heads of one KV group)
    block_n: int        # keys per K/V tile
    num_warps: int
    num_stages: int


def attention_smem_bytes(cfg: TileConfig, block_d: int, elem_bytes: int) -> int:
    """Shared memory one program of a flash-attention loop asks for: num_stages K and V tiles, the Q tile
    and the P tile that feeds the second dot."""
    kv_tiles = cfg.num_stages * 2 * cfg.block_n * block_d * elem_bytes
    return kv_tiles + cfg.block_m * block_d * elem_bytes + cfg.block_m * cfg.block_n * elem_bytes


def smem_limit_for(t: torch.Tensor) -> int:
    """Opt-in shared memory per block of t's device (the limit Triton checks a launch against)."""
    return tuned.device_spec(t.device).smem


def first_fitting(candidates: list[TileConfig], block_d: int, elem_bytes: int, smem_limit: int) -> TileConfig:
    """The first candidate whose estimate fits; past them all, the last one with fewer stages and
    narrower key tiles (down to 16 keys, one stage) until it fits."""
    for cfg in candidates:
        if attention_smem_bytes(cfg, block_d, elem_bytes) <= smem_limit:
            return cfg
    cfg = candidates[-1]
    while attention_smem_bytes(cfg, block_d, elem_bytes) > smem_limit:
        if cfg.num_stages > 1:
            cfg = TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages - 1)
        elif cfg.block_n > 16:
            cfg = TileConfig(cfg.block_m, cfg.block_n // 2, cfg.num_warps, 1)
        elif cfg.block_m > 16:
            cfg = TileConfig(cfg.block_m // 2, cfg.block_n, cfg.num_warps, 1)
        else:
            raise ValueError(f"head_dim padded to {block_d} with {elem_bytes}-byte elements does not fit "
                             f"{smem_limit} bytes of shared memory at the smallest tile")
    return cfg


def decode_config(block_g: int, block_n: int, block_d: int, elem_bytes: int, smem_limit: int,
                  num_warps: int = 4, num_stages: int = 2) -> TileConfig:
    """The split-KV decode program holds block_g query heads; block_n comes from the split count."""
    return first_fitting([TileConfig(block_g, block_n, num_warps, num_stages)], block_d, elem_bytes, smem_limit)


def gemv_smem_bytes(cfg: dict, w_bytes: int, x_bytes: int) -> int:
    """Shared memory one program of kernels/gemv.py asks for: num_stages weight and x tiles in flight, plus
    the float32 accumulator tile, which the epilogue's layout change (split-K store, argmax) stages there."""
    tiles = cfg["num_stages"] * cfg["BLOCK_K"] * (cfg["BLOCK_N"] * w_bytes + cfg["BLOCK_M"] * x_bytes)
    return tiles + cfg["BLOCK_N"] * cfg["BLOCK_M"] * 4


def fit_gemv_config(cfg: dict, w_bytes: int, x_bytes: int, smem_limit: int) -> dict:
    """cfg as it is if its estimate fits, else with fewer stages (down to 2), then narrower K tiles, then
    narrower column blocks, until it does: a tile measured in bf16 can ask for more than the chip has in
    float32 (the lm_head's 64-row tile: 425,984 bytes at 4 stages against the H200's 232,448)."""
    cfg = dict(cfg)
    while gemv_smem_bytes(cfg, w_bytes, x_bytes) > smem_limit:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["BLOCK_K"] > 32:
            cfg["BLOCK_K"] //= 2
        elif cfg["BLOCK_N"] > 16:
            cfg["BLOCK_N"] //= 2
        else:
            raise ValueError(f"gemv: a {cfg['BLOCK_M']}-row tile of {x_bytes}-byte elements does not fit "
                             f"{smem_limit} bytes of shared memory at the smallest tile")
    return cfg
