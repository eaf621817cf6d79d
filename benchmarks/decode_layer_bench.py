"""The small kernels of one decoder layer in a decode step, before and after their fusion, inside CUDA graphs
at the Qwen3-8B shape: batch 1, 4, 16, 64 x context 512, 4096 x a bf16 and an FP8 KV cache.

before (benchmarks/decode_baseline_kernels.py, frozen): q/k norm + rotary, the K/V store, split-KV decode
          in two launches (pieces, then the log-sum-exp reduction): 4 launches between qkv and o_proj.
after  (llmserve_core.kernels): q/k norm + rotary + K/V store in one kernel, decode in one launch whose
          last-arriving piece merges the rest: 2 launches.
Unchanged on both sides and timed once per batch: the residual add + RMSNorm kernel (already one kernel,
twice a layer) and SiLU-and-mul after gate_up.

First every fused kernel is checked on the GPU against its torch reference (and the baseline decode
against the same reference), including a decode graph replayed after its lengths change (the merge's
counters must re-arm). Then, per shape: each kernel alone, the attention block (everything between qkv and
o_proj), and a whole layer with its cuBLAS projections, each timed as many back-to-back copies in one
CUDA graph (median over replays). KV reads rotate over copies of the cache so that decode does not read
from L2; the whole layer streams 386 MB of weights between attention calls, as the model does. Last, a
sweep of the decode schedule (pieces, fewest keys per piece) at batch 1 and 4.

    python benchmarks/decode_layer_bench.py $OUT/decode_layer.json [--budget-s 80]
    python benchmarks/decode_layer_bench.py /tmp/smoke.json --smoke     # CPU interpreter, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(ROOT))
sys.path.insert(0, ROOT)

import llmserve_core.kernels  # noqa: E402,F401  (the interpreter on a machine without CUDA)
import decode_baseline_kernels as before  # noqa: E402
from llmserve_core.kernels.attention_reference import paged_attention_reference  # noqa: E402
from llmserve_core.kernels.fp8_format import FP8, to_cache_dtype  # noqa: E402
from llmserve_core.kernels.paged_decode import DecodeScratch, choose_num_splits, paged_decode  # noqa: E402
from llmserve_core.kernels.qk_norm_rope import qk_norm_rope_store, qk_norm_rope_store_reference  # noqa: E402
from llmserve_core.kernels.rmsnorm import rmsnorm  # noqa: E402
from llmserve_core.kernels.silu_mul import silu_mul  # noqa: E402
from qwen3_8b import QWEN3_8B_CONFIG  # noqa: E402

ROTATE_BYTES = 192 << 20      # KV read per graph replay of the small kernels: three times the H200's L2
MAX_COPIES = 64
LAYERS_PER_GRAPH = 4
K_SCALE, V_SCALE = 0.02, 0.01


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    block_size: int = 16
    eps: float = 1e-6


QWEN3_8B = Shape(QWEN3_8B_CONFIG["hidden_size"], QWEN3_8B_CONFIG["num_attention_heads"],
                 QWEN3_8B_CONFIG["num_key_value_heads"], QWEN3_8B_CONFIG["head_dim"],
                 QWEN3_8B_CONFIG["intermediate_size"])
SMOKE = Shape(64, 4, 2, 16, 96, block_size=8)


def rel_err(out, ref) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


class Case:
    """One (batch, context, KV dtype): the qkv rows of this step, `copies` paged caches (scattered blocks)
    with each sequence's last slot free for this step's K/V, and what the layer's other kernels read."""

    def __init__(self, s: Shape, batch: int, ctx: int, kv: str, copies: int, device, dtype, seed: int,
                 num_splits: int | None = None):
        g = torch.Generator(device=device).manual_seed(seed)
        self.s, self.batch, self.ctx, self.kv = s, batch, ctx, kv
        self.num_splits = num_splits          # None: the engine's choice from the batch size
        self.cache_dtype = FP8 if kv == "fp8" else dtype
        self.k_scale, self.v_scale = (K_SCALE, V_SCALE) if kv == "fp8" else (1.0, 1.0)
        rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)  # noqa
        self.qkv = rnd(batch, (s.heads + 2 * s.kv_heads) * s.head_dim, scale=2.0)
        self.qw, self.kw = (torch.rand(s.head_dim, generator=g, device=device) + 0.5).to(dtype), \
            (torch.rand(s.head_dim, generator=g, device=device) + 0.5).to(dtype)
        positions = torch.arange(8192, device=device).float()[:, None]
        freqs = positions * (1e6 ** (-torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim))[None]
        self.cos, self.sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        self.positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        blocks_per_seq = -(-ctx // s.block_size)
        num_blocks = batch * blocks_per_seq + 1              # block 0 stays unused
        self.tables, self.slots, self.caches = [], [], []
        for _ in range(copies):
            perm = torch.randperm(num_blocks - 1, generator=g, device=device).to(torch.int32) + 1
            table = perm.view(batch, blocks_per_seq)
            self.tables.append(table)
            last = ctx - 1
            self.slots.append(table[:, last // s.block_size].long() * s.block_size + last % s.block_size)
            shape = (num_blocks, s.block_size, s.kv_heads, s.head_dim)
            self.caches.append(tuple(to_cache_dtype(torch.randn(shape, generator=g, device=device, dtype=dtype),
                                                    self.cache_dtype, scale) for scale in (self.k_scale, self.v_scale)))
        self.out = torch.empty(batch, s.heads, s.head_dim, dtype=dtype, device=device)
        self.scratch = DecodeScratch()
        self.v_slice = self.qkv[:, (s.heads + s.kv_heads) * s.head_dim:].view(batch, s.kv_heads, s.head_dim)

    @property
    def kv_bytes(self) -> int:
        s = self.s
        return 2 * self.batch * self.ctx * s.kv_heads * s.head_dim * self.cache_dtype.itemsize

    # -- the two versions of what runs between qkv and o_proj -------------------------------------------
    def qk_before(self, c: int):
        s = self.s
        q, k = before.qk_norm_rope(self.qkv, self.positions, self.qw, self.kw, self.cos, self.sin, s.eps,
                                   s.heads, s.kv_heads, s.head_dim)
        return q, k

    def store_before(self, c: int, k):
        before.store_kv(k, self.v_slice, *self.caches[c], self.slots[c], self.k_scale, self.v_scale)

    def decode_before(self, c: int, q):
        return before.paged_decode_two_launches(q, *self.caches[c], self.tables[c], self.seq_lens,
                                                self.s.head_dim ** -0.5, out=self.out, scratch=self.scratch,
                                                num_splits=self.num_splits, k_scale=self.k_scale,
                                                v_scale=self.v_scale)

    def attention_before(self, c: int):
        q, k = self.qk_before(c)
        self.store_before(c, k)
        return self.decode_before(c, q)

    def qk_after(self, c: int):
        s = self.s
        return qk_norm_rope_store(self.qkv, self.positions, self.slots[c], self.qw, self.kw, self.cos, self.sin,
                                  s.eps, s.heads, s.kv_heads, s.head_dim, *self.caches[c], self.k_scale, self.v_scale)

    def decode_after(self, c: int, q, **variant):
        variant.setdefault("num_splits", self.num_splits)
        return paged_decode(q, *self.caches[c], self.tables[c], self.seq_lens, self.s.head_dim ** -0.5, out=self.out,
                            scratch=self.scratch, k_scale=self.k_scale, v_scale=self.v_scale, **variant)

    def attention_after(self, c: int):
        return self.decode_after(c, self.qk_after(c))

    def reference(self, c: int, q):
        return paged_attention_reference(q, *self.caches[c], self.seq_lens, self.tables[c],
                                         self.s.head_dim ** -0.5, k_scale=self.k_scale, v_scale=self.v_scale)


class Timer:
    def __init__(self, cuda: bool, reps: int):
        self.cuda, self.reps = cuda, reps

    def us(self, launches: list) -> float:
        """Median microseconds per launch: all `launches` back to back in one CUDA graph, replayed."""
        if not self.cuda:
            # The interpreter compiles nothing and its times mean nothing, while each launch costs it a
            # great deal: one launch keeps the path working.
            t0 = time.perf_counter()
            launches[-1]()
            return (time.perf_counter() - t0) * 1e6
        for fn in launches:                 # compile and warm up outside the capture
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in launches:
                fn()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / len(launches))
        return statistics.median(times)


class Layer:
    """A decoder layer's projections (cuBLAS through F.linear) around either version of the small kernels."""

    def __init__(self, s: Shape, device, dtype):
        g = torch.Generator(device=device).manual_seed(7)
        w = lambda n, k: (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(dtype)  # noqa: E731
        self.s = s
        self.qkv = w((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden)
        self.o = w(s.hidden, s.heads * s.head_dim)
        self.gate_up = w(2 * s.inter, s.hidden)
        self.down = w(s.hidden, s.inter)
        self.norm1 = torch.ones(s.hidden, dtype=dtype, device=device)
        self.norm2 = torch.ones(s.hidden, dtype=dtype, device=device)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qkv, self.o, self.gate_up, self.down))

    def run(self, case: Case, c: int, h, residual, fused: bool):
        s = self.s
        x, residual = rmsnorm(h, self.norm1, s.eps, residual)
        case.qkv.copy_(F.linear(x, self.qkv))       # the case's qkv buffer: the small kernels read it there
        attn = case.attention_after(c) if fused else case.attention_before(c)
        h = F.linear(attn.view(case.batch, -1), self.o)
        x, residual = rmsnorm(h, self.norm2, s.eps, residual)
        return F.linear(silu_mul(F.linear(x, self.gate_up)), self.down), residual


def check(case: Case, dtype, device) -> dict:
    """The fused kernels against their torch references (and the baseline decode against the same one)."""
    s = case.s
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    kc, vc = (t.clone() for t in case.caches[0])
    kr, vr = (t.clone() for t in case.caches[0])
    q = qk_norm_rope_store(case.qkv, case.positions, case.slots[0], case.qw, case.kw, case.cos, case.sin, s.eps,
                           s.heads, s.kv_heads, s.head_dim, kc, vc, case.k_scale, case.v_scale)
    qr = qk_norm_rope_store_reference(case.qkv, case.positions, case.slots[0], case.qw, case.kw, case.cos, case.sin,
                                      s.eps, s.heads, s.kv_heads, s.head_dim, kr, vr, case.k_scale, case.v_scale)
    rows = case.slots[0]
    blocks, offsets = rows // s.block_size, rows % s.block_size

    def stored(cache):          # this step's rows, gathered as bytes (indexing FP8 directly is not everywhere)
        return cache.view(torch.uint8)[blocks, offsets].view(cache.dtype).float() if cache.dtype == FP8 \
            else cache[blocks, offsets].float()
    errs = {"qk_q": rel_err(q, qr), "qk_k": rel_err(stored(kc), stored(kr)), "qk_v": rel_err(stored(vc), stored(vr))}
    del kc, vc, kr, vr
    ref = case.reference(0, q)
    errs["decode"] = rel_err(case.decode_after(0, q).clone(), ref)
    errs["decode_before"] = rel_err(case.decode_before(0, q).clone(), ref)
    if device.type == "cuda" and case.batch <= 4:
        # A captured decode replays right after its lengths change: the merge's counters re-armed.
        graph = torch.cuda.CUDAGraph()
        case.decode_after(0, q)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = case.decode_after(0, q)
        worst = 0.0
        for n in (case.ctx, max(1, case.ctx // 3), 17, 1):
            case.seq_lens.fill_(n)
            graph.replay()
            torch.cuda.synchronize()
            worst = max(worst, rel_err(out, case.reference(0, q)))
        case.seq_lens.fill_(case.ctx)
        errs["decode_graph_replays"] = worst
    errs["ok"] = all(v < tol for v in errs.values())
    return errs


def copies_for(case_bytes: int, cuda: bool) -> int:
    if not cuda:
        return 2
    return max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(1, case_bytes))))


def kv_bytes_of(s: Shape, batch: int, ctx: int, kv: str, dtype) -> int:
    return 2 * batch * ctx * s.kv_heads * s.head_dim * (1 if kv == "fp8" else dtype.itemsize)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--budget-s", type=float, default=80.0, help="stop starting new shapes after this long")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="512,4096")
    args = ap.parse_args(argv)
    t_start = time.time()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    s = QWEN3_8B if not args.smoke else SMOKE
    batches = [int(b) for b in args.batches.split(",")] if not args.smoke else [2]
    contexts = [int(c) for c in args.contexts.split(",")] if not args.smoke else [40]
    timer = Timer(cuda, reps=20 if cuda else 1)
    layer = Layer(s, device, dtype)
    result = {"meta": {"gpu": torch.cuda.get_device_name() if cuda else "cpu (interpreter smoke run)",
                       "torch": torch.__version__, "python": platform.python_version(), "shape": asdict(s),
                       "dtype": str(dtype), "layer_weight_bytes": layer.weight_bytes(),
                       "layers_per_graph": LAYERS_PER_GRAPH},
              "checks": [], "shapes": [], "per_batch": [], "decode_sweep": [], "skipped": []}

    def over_budget() -> bool:
        return time.time() - t_start > args.budget_s

    # Kernels that do not change, once per batch: the two residual-add RMSNorms and SiLU-and-mul.
    for batch in batches:
        h = torch.randn(batch, s.hidden, device=device, dtype=dtype)
        res = torch.randn_like(h)
        gu = torch.randn(batch, 2 * s.inter, device=device, dtype=dtype)
        result["per_batch"].append({"batch": batch,
                                    "rmsnorm_residual_us": timer.us([lambda: rmsnorm(h, layer.norm1, s.eps, res)] * 20),
                                    "silu_mul_us": timer.us([lambda: silu_mul(gu)] * 20)})

    for_sweep = []
    for kv in ("bf16", "fp8"):
        for ctx in contexts:
            for batch in batches:
                if over_budget():
                    result["skipped"].append({"batch": batch, "ctx": ctx, "kv": kv})
                    continue
                copies = copies_for(kv_bytes_of(s, batch, ctx, kv, dtype), cuda)
                # The interpreter runs every program: a few pieces keep the smoke run short, yet merged.
                case = Case(s, batch, ctx, kv, copies, device, dtype, seed=batch * 7 + ctx,
                            num_splits=4 if args.smoke else None)
                result["checks"].append({"batch": batch, "ctx": ctx, "kv": kv, **check(case, dtype, device)})
                cs = range(copies)
                q_b, k_b = case.qk_before(0)
                q_a = case.qk_after(0)
                row = {"batch": batch, "ctx": ctx, "kv": kv, "copies": copies,
                       "num_splits": choose_num_splits(batch, s.kv_heads), "kv_mb": case.kv_bytes / 2 ** 20}
                row["before"] = {
                    "qk_norm_rope_us": timer.us([lambda c=c: case.qk_before(c) for c in cs]),
                    "store_kv_us": timer.us([lambda c=c: case.store_before(c, k_b) for c in cs]),
                    "decode_split_reduce_us": timer.us([lambda c=c: case.decode_before(c, q_b) for c in cs]),
                    "attention_block_us": timer.us([lambda c=c: case.attention_before(c) for c in cs]),
                }
                row["after"] = {
                    "qk_norm_rope_store_us": timer.us([lambda c=c: case.qk_after(c) for c in cs]),
                    "decode_us": timer.us([lambda c=c: case.decode_after(c, q_a) for c in cs]),
                    "attention_block_us": timer.us([lambda c=c: case.attention_after(c) for c in cs]),
                }
                h = torch.randn(batch, s.hidden, device=device, dtype=dtype)
                res = torch.randn_like(h)
                for side, fused in (("before", False), ("after", True)):
                    row[side]["layer_us"] = timer.us(
                        [lambda c=c, f=fused: layer.run(case, c % copies, h, res, f) for c in range(LAYERS_PER_GRAPH)])
                row["attention_block_saved_us"] = row["before"]["attention_block_us"] - row["after"]["attention_block_us"]
                row["layer_saved_us"] = row["before"]["layer_us"] - row["after"]["layer_us"]
                result["shapes"].append(row)
                if batch in (1, 4) and kv == "bf16" and cuda:
                    for_sweep.append((case, q_a))       # small: kept for the schedule sweep at the end
                del case
                if cuda:
                    torch.cuda.empty_cache()
    for case, q in for_sweep:                           # last: the table above matters more
        if over_budget():
            result["skipped"].append({"sweep": [case.batch, case.ctx]})
            continue
        sweep(result, case, q, timer)
    result["meta"]["seconds"] = time.time() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(report(result))
    ok = all(c["ok"] for c in result["checks"])
    print(f"checks: {'all passed' if ok else 'FAILED'}; {result['meta']['seconds']:.0f} s; JSON: {args.out}")
    return 0 if ok else 1


def sweep(result: dict, case: Case, q, timer: Timer) -> None:
    """The decode schedule at a few (pieces, fewest keys per piece) points: what the default leaves."""
    cs = range(len(case.caches))
    default = choose_num_splits(case.batch, case.s.kv_heads)
    points = []
    for splits in sorted({default, 64, 32, 16, 8, 1}):
        for min_split in (None, 64, 128, 256):
            if splits == 1 and min_split is not None:
                continue
            us = timer.us([lambda c=c: case.decode_after(c, q, num_splits=splits, min_split=min_split) for c in cs])
            points.append({"num_splits": splits, "min_split": min_split or "tile", "us": us})
    best = min(points, key=lambda p: p["us"])
    result["decode_sweep"].append({"batch": case.batch, "ctx": case.ctx, "default_splits": default,
                                   "default_us": next(p["us"] for p in points
                                                      if p["num_splits"] == default and p["min_split"] == "tile"),
                                   "best": best, "points": points})


def report(result: dict) -> str:
    lines = [f"decode-layer small kernels, {result['meta']['gpu']}, {result['meta']['dtype']} "
             "(us per layer; before = frozen baseline, after = fused)"]
    nb = {r["batch"]: r for r in result["per_batch"]}
    lines.append("batch | ctx  | kv   | qk+store b/a    | decode b/a      | attn block b/a  | saved | layer b/a       "
                 "| saved | rms x2 | silu")
    for r in result["shapes"]:
        b, a = r["before"], r["after"]
        pb = nb[r["batch"]]
        lines.append(
            f"{r['batch']:5d} | {r['ctx']:4d} | {r['kv']:4s} | "
            f"{b['qk_norm_rope_us'] + b['store_kv_us']:6.2f} / {a['qk_norm_rope_store_us']:6.2f} | "
            f"{b['decode_split_reduce_us']:6.2f} / {a['decode_us']:6.2f} | "
            f"{b['attention_block_us']:6.2f} / {a['attention_block_us']:6.2f} | {r['attention_block_saved_us']:5.2f} | "
            f"{b['layer_us']:7.1f} / {a['layer_us']:7.1f} | {r['layer_saved_us']:5.2f} | "
            f"{2 * pb['rmsnorm_residual_us']:6.2f} | {pb['silu_mul_us']:5.2f}")
    for sw in result["decode_sweep"]:
        best = sw["best"]
        lines.append(f"decode schedule, batch {sw['batch']} ctx {sw['ctx']}: default {sw['default_splits']} pieces "
                     f"{sw['default_us']:.2f} us; best {best['num_splits']} pieces, >= {best['min_split']} keys "
                     f"{best['us']:.2f} us")
    bad = [c for c in result["checks"] if not c["ok"]]
    for c in bad:
        lines.append(f"CHECK FAILED: {c}")
    if result["skipped"]:
        lines.append(f"skipped for the time budget: {result['skipped']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
