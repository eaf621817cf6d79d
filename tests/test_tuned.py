"""Tuned kernel configs as data (kernels/tuned.py and kernels/configs/): the tables reproduce, on the H100
and H200, every kernel and tile the per-shape selectors they replaced chose at Qwen3-8B's shapes, its
tensor-parallel shards and its EAGLE-3 draft's (tests/data/kernel_choices_132sm.json, captured from those
selectors); a card or shape without an entry gets a valid tile from its kernel's heuristic; answers are
cached, read-only, and the writer the sweeps use round-trips."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import llmserve_core.kernels  # noqa: F401  (chooses the interpreter on CPU before any kernel is built)
from llmserve_core.kernels import tuned
from llmserve_core.kernels.fp8_gemv import choose, default_choice
from llmserve_core.kernels.gemv import gemv_tiles, projection_tiles, split_k_tile
from llmserve_core.kernels.paged_prefill import prefill_tiles
from llmserve_core.kernels.stream_gemv import stream_tiles
from llmserve_core.kernels.tiling import TileConfig, attention_smem_bytes, fit_gemv_config, gemv_smem_bytes
from llmserve_core.layers.linear import cublaslt_max_rows

CHOICES = json.loads((Path(__file__).parent / "data" / "kernel_choices_132sm.json").read_text())
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
BLOCKS = {"channel": None, "128x128": (128, 128), "none": None}


def answer(i: int):
    return CHOICES["answers"][i]


def as_dict(choice):
    return None if choice is None else {"kernel": choice.kernel, "tile": dict(choice.tile)}


@pytest.fixture(params=CHOICES["cards"])
def card(request) -> tuned.Device:
    """A card of today's tables, as the engine sees it (fresh caches, the tree's tables)."""
    tuned.clear_cache()
    return tuned.Device(tuned.device_name(request.param), sms=CHOICES["sms"], smem=CHOICES["smem"],
                        capability=tuple(CHOICES["capability"]))


def test_gemv_tiles_are_the_selectors(card):
    checked = 0
    for n, k, dtype, first, last, i in CHOICES["gemv"]:
        for rows in range(first, last + 1):
            assert gemv_tiles(card, rows, n, k, DTYPES[dtype]) == answer(i), (n, k, dtype, rows)
            checked += 1
    for n, k, dtype, first, last, i in CHOICES["projection"]:
        for rows in range(first, last + 1):
            got = projection_tiles(card, rows, n, k, DTYPES[dtype])
            assert (None if got is None else dict(got)) == answer(i), (n, k, dtype, rows)
    assert checked == 64 * len({(n, k, dtype) for n, k, dtype, *_ in CHOICES["gemv"]})    # 1-64 rows of each


def test_fp8_choices_are_the_selectors(card):
    for n, k, scale, x, stream, first, last, i in CHOICES["fp8"]:
        for rows in range(first, last + 1):
            for on_chain in ((False, True) if stream is None else (stream,)):
                got = choose(card, rows, n, k, BLOCKS[scale], x=x, stream=on_chain)
                assert as_dict(got) == answer(i), (n, k, scale, x, on_chain, rows)
    for n, k, scale, first, last, i in CHOICES["fp8_default"]:
        for rows in range(first, last + 1):
            assert as_dict(default_choice(card, rows, n, k, BLOCKS[scale])) == answer(i), (n, k, scale, rows)
    # what the Qwen3-8B decode chain runs at one row: the stream kernel, whole rows for every FP8 projection
    # but down_proj's 128 x 128 blocks
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        for block in (None, (128, 128)):
            got = choose(card, 1, n, k, block, stream=True)
            assert got.kernel == "stream" and got.tile["DEPTH"] == (1 if block and k == 12288 else 0)


def test_stream_prefill_and_cublaslt_choices_are_the_selectors(card):
    for n, k, dtype, scale, i in CHOICES["stream"]:
        got = stream_tiles(card, n, k, DTYPES[dtype], BLOCKS[scale])
        assert (None if got is None else dict(got)) == answer(i), (n, k, dtype, scale)
    for head_dim, dtype, query, i in CHOICES["prefill"]:
        tile = prefill_tiles(card, head_dim, DTYPES[dtype], short=query == "short")
        assert tile == TileConfig(*(answer(i)[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")))
    for n, k, dtype, i in CHOICES["cublaslt"]:
        assert cublaslt_max_rows(card, n, k, DTYPES[dtype]) == answer(i), (n, k, dtype)


def power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


UNTUNED = [(5000, 3000), (5120, 5120), (13824, 5120), (5120, 13824), (100, 96), (48, 64), (152064, 5120)]


@pytest.mark.parametrize("name,sms", [("NVIDIA_H200", 132), ("Some_Future_GPU", 100), ("Small_Card", 20)])
def test_untuned_cards_and_shapes_get_valid_heuristic_tiles(name, sms):
    """Never an error: a tile of powers of two that holds the rows, a K split that divides K, tiles that
    fit the card's shared memory; an untuned shape on a tuned card gets the same heuristic."""
    tuned.clear_cache()
    card = tuned.Device(name, sms=sms, smem=101_376 if sms == 20 else 232_448, capability=(9, 0))
    for n, k in UNTUNED:
        for rows in (1, 2, 5, 16, 17, 33, 64):
            for dtype in (torch.bfloat16, torch.float32):
                tile = gemv_tiles(card, rows, n, k, dtype)
                assert all(power_of_two(tile[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"))
                assert tile["BLOCK_M"] >= rows
                assert tile["SPLIT_K"] == 1 or k % (tile["SPLIT_K"] * tile["BLOCK_K"]) == 0
                assert gemv_smem_bytes(tile, dtype.itemsize, dtype.itemsize) <= card.smem
                # untuned: the rule, fitted to the card's shared memory
                assert tile == fit_gemv_config(split_k_tile(rows, n, k, sms), dtype.itemsize, dtype.itemsize, card.smem)
                assert projection_tiles(card, rows, n, k, dtype) is None           # cuBLAS where nothing was tuned
            for block in (None, (128, 128), (64, 64)):
                got = choose(card, rows, n, k, block)
                if rows > 16:                   # past the rule's rows only a tuned tile runs: the W8A8 GEMM
                    assert got is None and choose(card, rows, n, k, block, x="fp8") is None
                    continue
                assert got.kernel == "a8" and power_of_two(got.tile["BLOCK_K"]) and rows <= got.tile["BLOCK_M"]
                assert block is None or block[1] % got.tile["BLOCK_K"] == 0
                assert choose(card, rows, n, k, block, x="fp8") is None           # never quantized ahead untuned
                if rows == 1 and k % 64 == 0:   # on the decode chain the stream kernel only where tuned
                    assert choose(card, 1, n, k, block, stream=True) == got
        for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
            tile = stream_tiles(card, n, k, dtype)
            if k % 64:
                assert tile is None                  # no tile divides K: F.linear
            else:
                pieces = tile.get("PIECES", 1)
                assert k % tile["BLOCK_K"] == 0 and power_of_two(tile["BLOCK_K"]) and power_of_two(tile["BLOCK_N"])
                assert tile["DEPTH"] in (0, 1, 2) and (tile["DEPTH"] > 0 or tile["BLOCK_K"] * pieces == k)
        assert cublaslt_max_rows(card, n, k, torch.bfloat16) in (0, 48, 64)
    for head_dim in (64, 80, 128, 256):
        for dtype in (torch.bfloat16, torch.float32):
            for short in (False, True):
                tile = prefill_tiles(card, head_dim, dtype, short)
                assert attention_smem_bytes(tile, 1 << math.ceil(math.log2(head_dim)), dtype.itemsize) <= card.smem


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_this_card_is_read_as_its_tables_card():
    """On an H100 or H200 the device torch reports is the Device the captured choices above were checked for
    (name as its tables spell it, 132 multiprocessors, its shared memory, sm_90), so the engine on it runs
    those choices; on another card there is nothing to compare."""
    name = torch.cuda.get_device_name()
    if name not in CHOICES["cards"]:
        pytest.skip(f"{name}: the captured choices are the H100's and H200's")
    tuned.clear_cache()
    assert tuned.device_spec(torch.device("cuda")) == tuned.Device(
        tuned.device_name(name), sms=CHOICES["sms"], smem=CHOICES["smem"], capability=tuple(CHOICES["capability"]))
    for kernel in ("gemv", "fp8_gemv", "stream_gemv", "paged_prefill", "cublaslt"):
        assert tuned.config_path(kernel, name).is_file(), kernel


def test_the_interpreter_gets_the_heuristic():
    """Off CUDA the device is `tuned.CPU`: no table, a few multiprocessors, no shared-memory fitting."""
    cpu = tuned.device_spec(torch.device("cpu"))
    assert cpu == tuned.CPU and not cpu.fp8_dot and cpu.smem == 0
    assert gemv_tiles(cpu, 3, 6144, 4096, torch.bfloat16) == split_k_tile(3, 6144, 4096, cpu.sms)
    assert choose(cpu, 4, 6144, 4096).kernel == "dot"                # no FP8 products: the weight widened


def test_answers_are_cached_and_read_only(card):
    """Tables are read once a process and answers come from a cache (the engine asks while it builds and warms
    up; an eager step's repeat is a dictionary hit), and no caller can change a cached answer."""
    choice = choose(card, 4, 6144, 4096, (128, 128))
    reads = tuned._table.cache_info().misses
    for rows in (2, 3, 4) * 100:
        assert choose(card, rows, 6144, 4096, (128, 128)) == choice
        gemv_tiles(card, rows, 4096, 4096, torch.bfloat16)
        tuned.lookup("fp8_gemv", card, N=6144, K=4096, rows=4, scale="channel", x="raw")
    assert tuned._table.cache_info().misses <= reads + 1       # (the gemv table, read once)
    assert choose.cache_info().hits >= 298      # (rows 2 and 3 asked once each)
    with pytest.raises(TypeError):
        choice.tile["BLOCK_N"] = 1
    with pytest.raises(TypeError):
        gemv_tiles(card, 4, 4096, 4096, torch.bfloat16)["SPLIT_K"] = 1


def test_write_configs_round_trips_through_lookup(tmp_path, monkeypatch):
    """The sweeps' writer: a device name as torch reports it, spelled as lookup spells it; entries merged,
    replaced or removed (None), sorted numerically, one a line; a source listed once; a table keyed otherwise
    is refused, and so is a shape that misses a key."""
    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=3)
    shape = {"N": 512, "K": 256, "rows": 16, "dtype": "bf16"}
    path = tuned.write_configs("gemv", "NVIDIA H100 80GB HBM3", [(shape, tile), (dict(shape, N=96), tile)], "run 1")
    assert path == tmp_path / "gemv" / "device=NVIDIA_H100_80GB_HBM3.json"
    card = tuned.Device("NVIDIA_H100_80GB_HBM3", sms=132)
    assert gemv_tiles(card, 9, 512, 256, torch.bfloat16) == tile
    tuned.write_configs("gemv", "NVIDIA H100 80GB HBM3", [(shape, None), (dict(shape, N=1024), dict(tile, SPLIT_K=1))],
                        "run 1")
    text = path.read_text()
    assert [line.split('"')[1] for line in text.splitlines() if line.startswith('    "N=')] == \
        ["N=96,K=256,rows=16,dtype=bf16", "N=1024,K=256,rows=16,dtype=bf16"]
    data = json.loads(text)
    assert data["sources"] == ["run 1"] and data["device"] == "NVIDIA_H100_80GB_HBM3"
    assert gemv_tiles(card, 9, 512, 256, torch.bfloat16) == split_k_tile(9, 512, 256, 132)    # removed: the rule
    assert gemv_tiles(card, 9, 1024, 256, torch.bfloat16)["SPLIT_K"] == 1
    with pytest.raises(ValueError, match="keyed by"):
        tuned.write_configs("gemv", "NVIDIA H100 80GB HBM3", [({"N": 1, "K": 1}, tile)], "run 2", keys=("N", "K"))
    with pytest.raises(KeyError, match="keyed by"):
        tuned.lookup("gemv", card, N=512, K=256, rows=16)
    with pytest.raises(KeyError, match="no kernel family"):
        tuned.lookup("no_such_kernel", card, N=1)


def test_every_table_is_keyed_as_its_kernel_reads_it():
    """Each file under kernels/configs/ names its kernel, device and keys as the kernel's module registers
    them, and every entry's shape key parses back into those keys."""
    files = sorted(tuned.CONFIG_DIR.glob("*/device=*.json"))
    assert {f.parent.name for f in files} == {"gemv", "fp8_gemv", "stream_gemv", "paged_prefill", "cublaslt"}
    for f in files:
        data = json.loads(f.read_text())
        assert (data["kernel"], f"device={data['device']}.json") == (f.parent.name, f.name)
        assert tuple(data["keys"]) == tuned._FAMILIES[data["kernel"]].keys and data["sources"]
        for key in data["configs"]:
            assert [part.split("=")[0] for part in key.split(",")] == data["keys"], (f, key)
