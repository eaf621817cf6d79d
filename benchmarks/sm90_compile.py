"""The engine's Triton kernels compiled for Hopper (sm_90, the H100 and H200) on any machine, no GPU needed:
each variant's shared memory against the cards' opt-in limit, its registers, its global loads that wait
behind a barrier after the PDL wait (late_loads) and its SASS instruction mix.

Each kernel's own wrapper is called as the engine calls it, with CPU tensors standing in for CUDA ones and
the device queries answered as a 132-multiprocessor Hopper card would (232,448 bytes of shared memory a
block); the launch is replaced by Triton's compiler run on exactly the specialization the launch would
have had (argument alignment, constants, options) for target cuda:90, with the ptxas that Triton ships.
So the tile a wrapper picks for a dtype and head size is compiled as a GPU run would compile it, and a
tile that would not fit (issue 11's float32 prefill asked for 262,144 bytes) shows without a device.

    python benchmarks/sm90_compile.py                       # every set, a table
    python benchmarks/sm90_compile.py --sets attention,gemv --check --json out.json
    python benchmarks/sm90_compile.py --sets fp8 --sass     # with each variant's top SASS opcodes

--check exits non-zero when a variant fails to compile, needs more shared memory than the cards have, or
needs more than kernels/tiling.py's estimate for its tile (the estimate is what the wrappers fit tiles
with, so it must not undercount). tests/test_sm90_compile.py runs the attention and GEMV sets that way.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"      # compile, never interpret (before any kernel is decorated)

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from llmserve_core.kernels import tuned  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232_448       # opt-in shared memory per block on the H100 and H200
SMS = 132
HOPPER = tuned.Device("NVIDIA_H100_80GB_HBM3", sms=SMS, smem=SMEM_LIMIT, capability=(9, 0))   # (= the H200 tables)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD_DIMS = (64, 128, 256)
SETS = ("attention", "gemv", "fp8", "chain", "moe")


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict):
    """fn compiled for TARGET as a launch with these arguments would specialize it (JITFunction.run's own
    binder and packing, with this target's backend in place of the current device's)."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=kwargs.get("debug", False), instrumentation_mode="")
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


@contextlib.contextmanager
def compiling_instead_of_launching(record: list):
    """Within: every Triton launch compiles for TARGET and appends (kernel name, its launch kwargs, the
    compiled kernel or the exception) to record, launching nothing; the wrappers see a Hopper card."""
    def run(self, *args, grid, warmup, **kwargs):
        try:
            record.append((self.__name__, kwargs, compile_launch(self, args, kwargs)))
        except Exception as e:        # reported per variant, not fatal
            record.append((self.__name__, kwargs, e))

    patches = [(JITFunction, "run", run), (torch.Tensor, "is_cuda", property(lambda self: True)),
               (tuned, "device_spec", lambda device: HOPPER)]
    missing = object()          # (torch.Tensor's is_cuda lives on its C base class)
    saved = [(obj, name, obj.__dict__.get(name, missing)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def paged_cache(dtype, kv_heads: int, head_dim: int, seqs: int, ctx: int):
    """(k_cache, v_cache, block_tables, seq_lens) of `seqs` sequences of `ctx` tokens in 16-token pages,
    never touched (empty tensors: only their shapes, strides and alignment reach the compiler)."""
    blocks = seqs * (-(-ctx // 16)) + 1
    kc = torch.empty(blocks, 16, kv_heads, head_dim, dtype=dtype)
    tables = torch.arange(1, blocks, dtype=torch.int32).view(seqs, -1)
    return kc, torch.empty_like(kc), tables, torch.full((seqs,), ctx, dtype=torch.int32)


def attention_variants():
    """(label, call, estimate) for prefill (long and short queries) and decode (split and one piece) at
    each dtype and head size, Qwen3-8B's heads per KV head (4). estimate(kwargs): tiling.py's bytes."""
    from llmserve_core.kernels.paged_decode import paged_decode
    from llmserve_core.kernels.paged_prefill import paged_prefill
    from llmserve_core.kernels.tiling import TileConfig, attention_smem_bytes

    def estimate(rows_key, dtype):     # the tile's query rows are BLOCK_M in prefill, BLOCK_G in decode
        return lambda kw: attention_smem_bytes(TileConfig(kw[rows_key], kw["BLOCK_N"], kw["num_warps"],
                                                          kw["num_stages"]), kw["BLOCK_D"], dtype.itemsize)

    out = []
    for dname, dtype in DTYPES.items():
        for hd in HEAD_DIMS:
            for label, query in (("prefill", 512), ("prefill_short", 32)):
                kc, vc, bt, lens = paged_cache(dtype, 2, hd, 1, query)
                q = torch.empty(query, 8, hd, dtype=dtype)
                qsl = torch.tensor([0, query], dtype=torch.int32)
                out.append((f"{label} {dname} d{hd}",
                            lambda q=q, kc=kc, vc=vc, qsl=qsl, lens=lens, bt=bt, query=query:
                            paged_prefill(q, kc, vc, qsl, lens, bt, query, 0.1), estimate("BLOCK_M", dtype)))
            for label, batch in (("decode_split", 1), ("decode", 64)):
                kc, vc, bt, lens = paged_cache(dtype, 2, hd, batch, 512)
                q = torch.empty(batch, 8, hd, dtype=dtype)
                out.append((f"{label} {dname} d{hd}", lambda q=q, kc=kc, vc=vc, bt=bt, lens=lens:
                            paged_decode(q, kc, vc, bt, lens, 0.1), estimate("BLOCK_G", dtype)))
    return out


def gemv_variants():
    """The lm_head GEMV (Qwen3-8B's [151936, 4096], never touched: empty tensors) at each dtype and row
    tile, and its greedy argmax form; estimate: tiling.py's gemv_smem_bytes."""
    from llmserve_core.kernels.gemv import gemv, gemv_argmax
    from llmserve_core.kernels.tiling import gemv_smem_bytes

    out = []
    for dname, dtype in DTYPES.items():
        w = torch.empty(151936, 4096, dtype=dtype)
        estimate = (lambda kw, size=dtype.itemsize: gemv_smem_bytes(kw, size, size))
        for rows in (1, 16, 17, 64):
            x = torch.empty(rows, 4096, dtype=dtype)
            out.append((f"gemv {dname} rows {rows}", lambda x=x, w=w: gemv(x, w), estimate))
        x = torch.empty(16, 4096, dtype=dtype)
        out.append((f"gemv_argmax {dname} rows 16", lambda x=x, w=w: gemv_argmax(x, w), estimate))
    return out


def fp8_variants():
    """The FP8 projections at one row as the decode chain runs them (the stream kernel where the table names
    it), the a8 tiles 2-16 rows run (x quantized ahead where the table says so) and the same tiles with TMA
    weight loads; then the tables' 17-64-row tiles, per-channel and 128 x 128 block-scaled."""
    from llmserve_core.kernels.fp8_gemv import X_AHEAD_GROUP, choose, fp8_gemv
    from llmserve_core.kernels.stream_gemv import stream_gemv

    out = []
    for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                         "down": (4096, 12288)}.items():
        w, s = torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(n, dtype=torch.float32)
        x = torch.empty(1, k, dtype=torch.bfloat16)
        if choose(HOPPER, 1, n, k, stream=True).kernel == "stream":
            out.append((f"fp8 {name} stream", lambda x=x, w=w, s=s: stream_gemv(x, w, s, None, pdl=True), None))
        # the a8 tile (on x quantized ahead where the table has one) that 2-16 rows run, one row of it
        ahead = choose(HOPPER, 4, n, k, x="fp8")
        kernel, cfg = ahead or choose(HOPPER, 4, n, k)
        xq = torch.empty(1, k, dtype=torch.float8_e4m3fn)
        xs = torch.empty(1, k // X_AHEAD_GROUP, dtype=torch.float32)
        for tma in (False, True):
            label = f"fp8 {name} a8{'x' if ahead else ''}{' tma' if tma else ''}"
            config = dict(cfg, TMA=tma)
            if ahead:
                call = (lambda w=w, s=s, xq=xq, xs=xs, kernel=kernel, config=config:
                        fp8_gemv(xq, w, s, None, kernel=kernel, config=config, pdl=True, x_scale=xs,
                                 x_group=X_AHEAD_GROUP, out_dtype=torch.bfloat16))
            else:
                call = lambda x=x, w=w, s=s, kernel=kernel, config=config: fp8_gemv(x, w, s, None, kernel=kernel,
                                                                                     config=config, pdl=True)
            out.append((label, call, None))
        for block in (None, (128, 128)):
            scale = s if block is None else torch.empty(n // 128, k // 128, dtype=torch.float32)
            kind = "channel" if block is None else "block"
            for rows in (32, 64):       # the rows classes 17-32 and 33-64
                x = torch.empty(rows, k, dtype=torch.bfloat16)
                xq = torch.empty(rows, k, dtype=torch.float8_e4m3fn)
                xs = torch.empty(rows, k // X_AHEAD_GROUP, dtype=torch.float32)
                ahead = choose(HOPPER, rows, n, k, block, x="fp8")
                plain = choose(HOPPER, rows, n, k, block)
                if ahead:
                    out.append((f"fp8 {name} a8x rows {rows} {kind}",
                                lambda w=w, s=scale, xq=xq, xs=xs, b=block, c=ahead: fp8_gemv(
                                    xq, w, s, b, kernel=c.kernel, config=c.tile, pdl=True, x_scale=xs,
                                    x_group=X_AHEAD_GROUP, out_dtype=torch.bfloat16), None))
                if plain:
                    out.append((f"fp8 {name} a8 rows {rows} {kind}",
                                lambda x=x, w=w, s=scale, b=block, c=plain: fp8_gemv(
                                    x, w, s, b, kernel=c.kernel, config=c.tile, pdl=True), None))
    # a decode's gate_up ends in the SiLU-and-mul: one row on the stream kernel's whole rows, 2-16 rows on the
    # a8 tile over x quantized ahead
    w = torch.empty(24576, 4096, dtype=torch.float8_e4m3fn)
    x = torch.empty(1, 4096, dtype=torch.bfloat16)
    xq, xs = torch.empty(4, 4096, dtype=torch.float8_e4m3fn), torch.empty(4, 4096 // X_AHEAD_GROUP, dtype=torch.float32)
    for block, scale in ((None, torch.empty(24576)), ((128, 128), torch.empty(192, 32))):
        kind = "channel" if block is None else "block"
        out.append((f"fp8 gate_up stream silu_mul {kind}",
                    lambda b=block, s=scale: stream_gemv(x, w, s, b, pdl=True, silu_mul=True), None))
        out.append((f"fp8 gate_up a8x silu_mul {kind}",
                    lambda b=block, s=scale, c=choose(HOPPER, 4, 24576, 4096, block, x="fp8"): fp8_gemv(
                        xq, w, s, b, kernel=c.kernel, config=c.tile, pdl=True, x_scale=xs, x_group=X_AHEAD_GROUP,
                        out_dtype=torch.bfloat16, silu_mul=True), None))
    return out


def chain_variants():
    """The rest of what a step launches, with the GPU-only arguments the interpreter never compiles (PDL,
    FP8 caches and activations, verify rows and trees), at Qwen3-8B's sizes in bf16: the norms, the q/k
    norm + rotary + KV store, split decodes, the one-row stream GEMV and the few-row GEMVs under PDL,
    SiLU-and-mul, the sampler's race, activation quantization and the W8A8 prefill GEMM."""
    from llmserve_core.kernels.fp8_gemm import w8a8_gemm_triton
    from llmserve_core.kernels.fp8_format import RowQuant
    from llmserve_core.kernels.fp8_quant import quantize_activation
    from llmserve_core.kernels.gemv import gemv, gemv_argmax
    from llmserve_core.kernels.paged_decode import paged_decode
    from llmserve_core.kernels.qk_norm_rope import qk_norm_rope_store
    from llmserve_core.kernels.rmsnorm import rmsnorm
    from llmserve_core.kernels.sampling import race_argmax
    from llmserve_core.kernels.silu_mul import silu_mul
    from llmserve_core.kernels.stream_gemv import stream_gemv

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    h, w_norm = torch.empty(1, 4096, dtype=bf16), torch.empty(4096, dtype=bf16)
    qkv, cos = torch.empty(1, 6144, dtype=bf16), torch.empty(4096, 64, dtype=torch.float32)
    pos, slot = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    head_w = torch.empty(128, dtype=bf16)
    rows = torch.empty(256, 4096, dtype=bf16)

    out = [("rmsnorm + residual, pdl", lambda: rmsnorm(h, w_norm, 1e-6, residual=h, pdl=True), None),
           ("rmsnorm + residual, fp8 out, pdl", lambda: rmsnorm(h, w_norm, 1e-6, residual=h, pdl=True,
                                                               quant=RowQuant(128)), None),
           ("rmsnorm + residual, fp8 out per token", lambda: rmsnorm(rows, w_norm, 1e-6, residual=rows,
                                                                    quant=RowQuant(4096)), None)]
    for dtype in (bf16, fp8):
        kc, vc, bt, lens = paged_cache(dtype, 8, 128, 1, 512)
        name = "fp8 cache" if dtype == fp8 else "bf16 cache"
        out.append((f"qk norm + rope + store, {name}, pdl",
                    lambda kc=kc, vc=vc: qk_norm_rope_store(qkv, pos, slot, head_w, head_w, cos, cos, 1e-6, 32, 8, 128,
                                                            kc, vc, pdl=True), None))
        out.append((f"decode batch 1, {name}, pdl", lambda kc=kc, vc=vc, bt=bt, lens=lens:
                    paged_decode(torch.empty(1, 32, 128, dtype=bf16), kc, vc, bt, lens, 0.1, pdl=True), None))
        kc, vc, bt, lens = paged_cache(dtype, 8, 128, 128, 512)
        out.append((f"decode batch 128, {name}, pdl, rows quantized for o_proj",
                    lambda kc=kc, vc=vc, bt=bt, lens=lens:
                    paged_decode(torch.empty(128, 32, 128, dtype=bf16), kc, vc, bt, lens, 0.1, pdl=True,
                                 quant=RowQuant(128, m_major=True, pad_rows=4)), None))
        kc, vc, bt, lens = paged_cache(dtype, 8, 128, 4, 512)
        tree = torch.ones(16, 4, dtype=torch.bool)
        out.append((f"verify 4 x 4 rows, tree, {name}", lambda kc=kc, vc=vc, bt=bt, lens=lens, tree=tree:
                    paged_decode(torch.empty(16, 32, 128, dtype=bf16), kc, vc, bt, lens, 0.1, rows_per_seq=4,
                                 tree_mask=tree), None))
    w_qkv = torch.empty(6144, 4096, dtype=bf16)
    w_gate_up = torch.empty(24576, 4096, dtype=bf16)
    out += [("stream gemv qkv, pdl", lambda: stream_gemv(h, w_qkv, pdl=True), None),
            ("stream gemv gate_up, silu_mul, pdl", lambda: stream_gemv(h, w_gate_up, pdl=True, silu_mul=True), None),
            ("gemv qkv 4 rows, pdl", lambda: gemv(torch.empty(4, 4096, dtype=bf16), w_qkv, pdl=True), None),
            ("gemv_argmax 4 rows, pdl", lambda: gemv_argmax(torch.empty(4, 4096, dtype=bf16), w_qkv, pdl=True), None),
            ("silu_mul, pdl", lambda: silu_mul(torch.empty(1, 24576, dtype=bf16), pdl=True), None),
            ("silu_mul, fp8 out, pdl", lambda: silu_mul(torch.empty(64, 24576, dtype=bf16), pdl=True, quant=RowQuant(128)),
             None),
            ("silu_mul, fp8 out per token", lambda: silu_mul(torch.empty(256, 24576, dtype=bf16),
                                                             quant=RowQuant(12288)), None),
            ("race_argmax 64 rows", lambda: race_argmax(torch.empty(64, 151936, dtype=torch.float32),
                                                        torch.ones(64), torch.empty(64, 151936)), None),
            ("quantize_activation per 128", lambda: quantize_activation(torch.empty(512, 4096, dtype=bf16), 128),
             None),
            ("w8a8 gemm 512 rows, 128x128 blocks",
             lambda: w8a8_gemm_triton(torch.empty(512, 4096, dtype=fp8), torch.empty(512, 32),
                                      torch.empty(24576, 4096, dtype=fp8), torch.empty(192, 32), (128, 128), bf16),
             None)]
    return out


def moe_variants():
    """The fused-MoE kernels at Qwen3-30B-A3B's shape (128 experts, top-8, hidden 2048, intermediate 768) on
    the heuristic default tiles, bf16 and FP8 (per channel, 128 x 128 blocks): route; the decode path at one
    row (CUDA cores) and 8 (tensor cores), its sum fused; the grouped path at 4,096 rows (the alignment, both
    GEMMs, the activation quantization, the per-token sum), whose 64-row blocks hold the most registers of
    its tiles (the 16-row blocks of 256 rows took 48-80 on sm_90, the 64-row ones 124-170)."""
    from llmserve_core.kernels.fused_moe import fused_moe, route

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    out = [("moe route", lambda: route(torch.empty(8, experts, dtype=bf16), top_k, True), None)]
    for kind, block in (("bf16", None), ("fp8 channel", None), ("fp8 block", (128, 128))):
        wd = bf16 if kind == "bf16" else fp8
        w13, w2 = torch.empty(experts, 2 * inter, hidden, dtype=wd), torch.empty(experts, hidden, inter, dtype=wd)
        scales = {"bf16": (None, None), "fp8 channel": (torch.empty(experts, 2 * inter), torch.empty(experts, hidden)),
                  "fp8 block": (torch.empty(experts, 12, 16), torch.empty(experts, 16, 6))}[kind]
        for rows in (1, 8, 4096):
            x = torch.empty(rows, hidden, dtype=bf16)
            weights, ids = torch.empty(rows, top_k), torch.zeros(rows, top_k, dtype=torch.int32)
            out.append((f"moe {kind} rows {rows}", lambda x=x, w=weights, i=ids, w13=w13, w2=w2, s=scales, b=block:
                        fused_moe(x, w13, w2, w, i, *s, b), None))
    return out


def ptxas_tool(name: str) -> str:
    import triton.backends.nvidia as nvidia
    return os.path.join(os.path.dirname(nvidia.__file__), "bin", name)


def cubin_resources(cubin: bytes, sass: bool) -> dict:
    """Registers (and spills) from cuobjdump's resource usage, and late_loads (below); with sass, the 12
    commonest SASS opcodes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([ptxas_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        # STACK: a thread's stack frame, where ptxas spills what its registers cannot hold
        out = {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
               "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1))}
        text = subprocess.run([ptxas_tool("cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text)
        out["late_loads"] = late_loads(ops)
        if sass:
            out["sass_top"] = collections.Counter(ops).most_common(12)
    return out


def late_loads(ops: list[str]) -> int:
    """Global loads (LDG) issued after the first barrier (BAR) that follows the PDL wait (ACQBULK; the
    start where there is none). A load there waits for what the barrier waits for, a reduction or a layout
    change, so its memory latency adds to the one before it instead of overlapping it: a kernel without a
    loop should have none (benchmarks/results/LOG.md, the round trips behind barriers)."""
    start = ops.index("ACQBULK") if "ACQBULK" in ops else 0
    barriers = [i for i in range(start, len(ops)) if ops[i] == "BAR"]
    return sum(op == "LDG" for op in ops[barriers[0]:]) if barriers else 0


def compile_set(variants, sass: bool) -> list[dict]:
    rows = []
    for label, call, estimate in variants:
        record = []
        start = time.perf_counter()
        with compiling_instead_of_launching(record):
            try:
                call()
            except Exception as e:     # the wrapper itself refused (reported, not fatal)
                record.append(("(wrapper)", {}, e))
        for kernel_name, kwargs, kernel in record:
            row = {"variant": label, "kernel": kernel_name, "compile_s": round(time.perf_counter() - start, 2),
                   "tile": {k: v for k, v in kwargs.items() if k.startswith("BLOCK_") or k.startswith("num_")
                            or k in ("SPLIT_K", "W_TMA", "DEPTH")}}
            if isinstance(kernel, Exception):
                row["error"] = f"{type(kernel).__name__}: {kernel}"[:400]
            else:
                row["shared_bytes"] = kernel.metadata.shared
                row.update(cubin_resources(kernel.asm["cubin"], sass))
                if estimate is not None and kernel_name not in ("_argmax_unpack_kernel",):
                    row["estimate_bytes"] = estimate(kwargs)
            rows.append(row)
    return rows


def problems(rows: list[dict]) -> list[str]:
    found = []
    for r in rows:
        where = f"{r['variant']} ({r['kernel']})"
        if "error" in r:
            found.append(f"{where}: {r['error']}")
            continue
        if r["shared_bytes"] > SMEM_LIMIT:
            found.append(f"{where}: {r['shared_bytes']} bytes of shared memory, the cards have {SMEM_LIMIT}")
        if r.get("estimate_bytes") is not None and r["shared_bytes"] > r["estimate_bytes"]:
            found.append(f"{where}: {r['shared_bytes']} bytes of shared memory, tiling.py estimated "
                         f"{r['estimate_bytes']} for its tile {r['tile']}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, from {', '.join(SETS)}")
    ap.add_argument("--check", action="store_true", help="exit 1 on a compile error, a tile over the cards' "
                    "shared memory or over tiling.py's estimate")
    ap.add_argument("--sass", action="store_true", help="also list each variant's commonest SASS opcodes")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    builders = {"attention": attention_variants, "gemv": gemv_variants, "fp8": fp8_variants,
                "chain": chain_variants, "moe": moe_variants}
    rows = []
    for name in args.sets.split(","):
        if name not in builders:
            sys.exit(f"sm90_compile: unknown set {name!r}, choose from {', '.join(SETS)}")
        rows += compile_set(builders[name](), args.sass)
    print("| variant | kernel | tile | shared bytes (estimate) | registers (spill stack) | late loads | compile s |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        tile = " ".join(f"{k}={v}" for k, v in r["tile"].items())
        if "error" in r:
            print(f"| {r['variant']} | {r['kernel']} | {tile} | error: {r['error'][:120]} | | | |")
            continue
        est = f" ({r['estimate_bytes']})" if r.get("estimate_bytes") is not None else ""
        stack = f", {r['stack_bytes']}-byte stack" if r["stack_bytes"] else ""
        print(f"| {r['variant']} | {r['kernel']} | {tile} | {r['shared_bytes']}{est} | {r['registers']}{stack} | "
              f"{r['late_loads']} | {r['compile_s']} |")
        if args.sass:
            print("|  |  | " + ", ".join(f"{op} {n}" for op, n in r["sass_top"]) + " | | | | |")
    found = problems(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": "cuda:90", "smem_limit": SMEM_LIMIT, "triton": triton.__version__, "rows": rows,
                       "problems": found}, f, indent=1)
    for p in found:
        print("PROBLEM:", p)
    if args.check and found:
        sys.exit(1)


if __name__ == "__main__":
    main()
