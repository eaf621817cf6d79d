"""Check and time the Triton kernels at Qwen3-8B shapes (32 q heads, 8 KV heads, head_dim 128, bf16).

Each kernel is first compared with its torch reference, then timed with CUDA events over a CUDA graph of
many back-to-back launches (launch overhead is not what is measured). Decode rotates among several copies
of the KV data so that repeated launches do not read from L2. FlashAttention-4 is timed at the same shapes
when `flash_attn.cute` imports. Writes results.json and results.md to the output dir; prints a table last.

    python3 benchmarks/kernels_bench.py OUT_DIR [--budget-s 240] [--smoke] [--prefill-only]

The prefill / extend table also says which kernel --attention-backend auto (triton-fa4) runs at each shape
and its speed relative to FA4 (the target: 0.8 or more); the short-extend rows set FA4_MIN_QUERY_LEN.
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
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "--smoke" in sys.argv[1:]:     # a smoke run is the CPU interpreter's, on a machine with a GPU too
    os.environ["TRITON_INTERPRET"] = "1"
import llmserve_core.kernels  # noqa: E402,F401  (interpreter on CPU for --smoke)
from llmserve_core.kernels.attention_reference import paged_attention_reference  # noqa: E402
from llmserve_core.kernels.fp8_format import FP8, to_cache_dtype  # noqa: E402
from llmserve_core.kernels.paged_decode import DecodeScratch, choose_num_splits, paged_decode  # noqa: E402
from llmserve_core.kernels.paged_prefill import paged_prefill  # noqa: E402
from llmserve_core.kernels.rmsnorm import rmsnorm, rmsnorm_reference  # noqa: E402
from llmserve_core.kernels.qk_norm_rope import qk_norm_rope_store, qk_norm_rope_store_reference  # noqa: E402
from llmserve_core.kernels.silu_mul import silu_mul, silu_mul_reference  # noqa: E402
from gemv_bench import warm_up_on_side_stream  # noqa: E402

ROTATE_BYTES = 256 << 20     # decode KV touched per graph replay, several times the 60 MB L2
# The scales of --fp8-kv's caches, as paged_decode / paged_prefill take them: randn / 0.02 stays inside 448.
FP8_KV_SCALES = {"k_scale": 0.02, "v_scale": 0.02}


class Bench:
    def __init__(self, out_dir: str, budget_s: float, smoke: bool):
        self.out_dir, self.smoke = out_dir, smoke
        self.deadline = time.time() + budget_s
        self.cuda = torch.cuda.is_available() and not smoke
        self.device = "cuda" if self.cuda else "cpu"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        if smoke:
            self.H, self.KVH, self.D = 4, 2, 16
        else:
            self.H, self.KVH, self.D = 32, 8, 128
        self.scale = self.D ** -0.5
        self.rows: list[dict] = []
        self.fa4 = load_fa4() if self.cuda else None
        self.fa4_graph = True   # cleared after the first failed capture, so later shapes time eagerly
        self.meta = {
            "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if self.cuda else "cpu (interpreter smoke run)",
            "fa4": "flash_attn.cute" if self.fa4 else "not importable",
            "heads": [self.H, self.KVH, self.D], "dtype": str(self.dtype),
        }
        try:
            import triton
            self.meta["triton"] = triton.__version__
        except ImportError:
            pass

    def time_left(self) -> float:
        return self.deadline - time.time()

    def add(self, **row):
        self.rows.append(row)
        self.save()

    def save(self):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "results.json"), "w") as f:
            json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)

    # ------------------------------------------------------------ timing

    def time_us(self, launches: list, reps: int = 15, use_graph: bool = True) -> tuple[float, str]:
        """Median microseconds per launch over `reps` timed runs of all `launches` back to back."""
        if not self.cuda:
            # The interpreter's times mean nothing, and each launch costs it a great deal: one launch keeps the
            # path working. The last one, since callers check what it leaves in their output.
            t0 = time.perf_counter()
            launches[-1]()
            return (time.perf_counter() - t0) * 1e6, "cpu-wall"
        for fn in launches:          # compile and warm up outside any capture
            fn()
        torch.cuda.synchronize()
        run, method = None, "eager-events"
        if use_graph:
            try:
                warm_up_on_side_stream(launches)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for fn in launches:
                        fn()
                run, method = graph.replay, "cuda-graph"
            except Exception as e:  # some libraries cannot be captured; fall back to eager launches
                torch.cuda.synchronize()
                method = f"eager-events (graph failed: {type(e).__name__})"
        if run is None:
            def run():
                for fn in launches:
                    fn()
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / len(launches))
        return statistics.median(times), method

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    # ------------------------------------------------------------ data

    def paged_kv(self, seq_lens: list[int], block_size: int, copies: int, fp8: bool = False, ordered: bool = False):
        """K/V caches holding `copies` disjoint, scattered block tables for the same sequences (with ordered,
        each sequence's blocks in a row, as a fresh engine's allocator hands them out); with fp8, e4m3 caches
        at FP8_KV_SCALES."""
        per_seq = [math.ceil(s / block_size) for s in seq_lens]
        width = max(per_seq)
        per_copy = sum(per_seq)
        num_blocks = copies * per_copy + 1
        shape = (num_blocks, block_size, self.KVH, self.D)
        kc = torch.randn(shape, device=self.device, dtype=self.dtype)
        vc = torch.randn(shape, device=self.device, dtype=self.dtype)
        if fp8:
            kc = to_cache_dtype(kc, FP8, FP8_KV_SCALES["k_scale"])
            vc = to_cache_dtype(vc, FP8, FP8_KV_SCALES["v_scale"])
        perm = torch.arange(1, num_blocks) if ordered else torch.randperm(num_blocks - 1) + 1
        tables = []
        for c in range(copies):
            chunk = perm[c * per_copy:(c + 1) * per_copy].tolist()
            rows, at = [], 0
            for n in per_seq:
                rows.append(chunk[at:at + n] + [0] * (width - n))
                at += n
            tables.append(torch.tensor(rows, dtype=torch.int32, device=self.device))
        return kc, vc, tables

    # ------------------------------------------------------------ decode

    def decode_inputs(self, batch: int, ctx: int, block_size: int, fp8: bool = False, ordered: bool = False):
        """(K/V bytes a launch reads, KV copies, k_cache, v_cache, the copies' block tables, lengths, q) for
        `batch` sequences of `ctx` keys, the copies together larger than L2."""
        kv_bytes = batch * ctx * self.KVH * self.D * 2 * (1 if fp8 else self.dtype.itemsize)
        copies = max(1, min(64, math.ceil(ROTATE_BYTES / kv_bytes))) if self.cuda else 1
        kc, vc, tables = self.paged_kv([ctx] * batch, block_size, copies, fp8, ordered)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=self.device)
        q = torch.randn(batch, self.H, self.D, device=self.device, dtype=self.dtype)
        return kv_bytes, copies, kc, vc, tables, lens, q

    def decode(self, batch: int, ctx: int, block_size: int, with_fa4: bool, sweep=(), fp8: bool = False):
        kv_bytes, copies, kc, vc, tables, lens, q = self.decode_inputs(batch, ctx, block_size, fp8)
        scales = FP8_KV_SCALES if fp8 else {}
        out = torch.full_like(q, float("nan"))
        scratch = DecodeScratch()
        check = min(batch, 8)
        ref = paged_attention_reference(q[:check], kc, vc, lens[:check], tables[0][:check], self.scale, **scales)
        shape = dict(kind="decode", batch=batch, ctx=ctx, block_size=block_size, kv_bytes=kv_bytes,
                     kv_copies=copies, kv="fp8" if fp8 else "model")
        n_launch = max(copies, 4 if kv_bytes > ROTATE_BYTES else 8)

        variants = [{}] + list(sweep)
        last = tables[(n_launch - 1) % copies]
        ref_last = paged_attention_reference(q[:check], kc, vc, lens[:check], last[:check], self.scale, **scales)
        for var in variants:
            splits = var.get("num_splits") or choose_num_splits(batch, self.KVH)
            try:
                paged_decode(q, kc, vc, tables[0], lens, self.scale, out=out, scratch=scratch, **var, **scales)
                err = rel_err(out[:check], ref)
                launches = [lambda t=tables[i % copies]: paged_decode(q, kc, vc, t, lens, self.scale, out=out,
                                                                      scratch=scratch, **var, **scales)
                            for i in range(n_launch)]
                us, method = self.time_us(launches)
                # After the timed graph replays, out holds the last launch's result: check it too.
                err_after = rel_err(out[:check], ref_last)
                impl = "triton" + ("" if not var else " " + ",".join(f"{k}={v}" for k, v in var.items()))
                self.add(**shape, impl=impl, num_splits=splits, us=us, tbps=kv_bytes / us / 1e6,
                         rel_err=max(err, err_after), method=method)
            except Exception as e:
                self.add(**shape, impl=f"triton {var}", error=f"{type(e).__name__}: {e}"[:300])

        if with_fa4 and self.fa4 is not None and not fp8:
            for splits in (1,):
                def fa4_call(t, splits=splits):
                    return fa4_decode(self.fa4, q, kc, vc, t, lens, self.scale, splits)
                try:
                    got = fa4_call(tables[0])
                    err = rel_err(got[:check], ref)
                    us, method = self.time_us([lambda t=tables[i % copies]: fa4_call(t) for i in range(n_launch)],
                                              use_graph=self.fa4_graph)
                    self.fa4_graph = method == "cuda-graph"
                    self.add(**shape, impl=f"fa4 num_splits={splits}", us=us, tbps=kv_bytes / us / 1e6,
                             rel_err=err, method=method)
                except Exception as e:
                    self.add(**shape, impl=f"fa4 num_splits={splits}", error=f"{type(e).__name__}: {e}"[:300])
        kc = vc = None

    def decode_after_gemm(self, batch: int, ctx: int, block_size: int = 16):
        """The decode as a step runs it, each launch right after a GEMM of qkv_proj's shape (cuBLAS), against
        the decode alone and the GEMM alone (us a launch; after = the pair's time less the GEMM's), at the
        keys decode_profile's kernel table attends: whether the step's attention reads its K/V as fast as the
        kernel alone, and whether the state a GEMM leaves the card in (clocks, L2) costs it anything."""
        kv_bytes, copies, kc, vc, tables, lens, q = self.decode_inputs(batch, ctx, block_size, ordered=True)
        out = torch.empty_like(q)
        scratch = DecodeScratch()
        hidden, qkv = self.H * self.D, (self.H + 2 * self.KVH) * self.D
        x = torch.randn(batch, hidden, device=self.device, dtype=self.dtype)
        w = torch.randn(qkv, hidden, device=self.device, dtype=self.dtype) * hidden ** -0.5
        y = torch.empty(batch, qkv, device=self.device, dtype=self.dtype)
        n = max(copies, 4) if self.cuda else 1
        decodes = [lambda t=tables[i % copies]: paged_decode(q, kc, vc, t, lens, self.scale, out=out, scratch=scratch)
                   for i in range(n)]
        gemms = [lambda: torch.matmul(x, w.t(), out=y)] * n
        alone, method = self.time_us(decodes)
        gemm, _ = self.time_us(gemms)
        pair, _ = self.time_us([f for d in decodes for f in (gemms[0], d)])
        check = min(batch, 8)
        last = tables[(n - 1) % copies]
        err = rel_err(out[:check], paged_attention_reference(q[:check], kc, vc, lens[:check], last[:check],
                                                             self.scale))
        shape = dict(kind="decode_after_gemm", batch=batch, ctx=ctx, block_size=block_size, rel_err=err,
                     method=method)
        self.add(**shape, impl="decode alone", us=alone, tbps=kv_bytes / alone / 1e6)
        self.add(**shape, impl=f"gemm [{batch}, {hidden}] x [{hidden}, {qkv}] alone", us=gemm)
        after = 2 * pair - gemm
        self.add(**shape, impl="decode after the gemm", us=after, tbps=kv_bytes / max(after, 1e-9) / 1e6)

    # ------------------------------------------------------------ verify (a few rows per sequence)

    def verify(self, batch: int, rows: int, ctx: int, block_size: int, tree: bool, sweep=()):
        """A speculative verify through the decode kernel's rows path: `rows` query rows per sequence after
        `ctx` cached tokens, causal or under a random tree mask (each node's parent before it), against the
        prefill kernel on the same rows and the torch reference."""
        seq_lens = [ctx + rows] * batch
        kc, vc, tables = self.paged_kv(seq_lens, block_size, 1)
        bt = tables[0]
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        q = torch.randn(batch * rows, self.H, self.D, device=self.device, dtype=self.dtype)
        qsl = torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32, device=self.device)
        mask = None
        if tree:
            gen = torch.Generator().manual_seed(rows)
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, rows)]
            m = torch.eye(rows, dtype=torch.bool)
            for i in range(1, rows):
                m[i] |= m[parents[i]]
            mask = m.repeat(batch, 1).to(self.device)
        out = torch.full_like(q, float("nan"))
        check = min(batch, 4)
        ref = paged_attention_reference(q[:check * rows], kc, vc, lens[:check], bt[:check], self.scale,
                                        query_start_loc=qsl[:check + 1], tree_mask=mask)
        kv_bytes = batch * (ctx + rows) * self.KVH * self.D * 2 * self.dtype.itemsize
        shape = dict(kind="verify", batch=batch, query_len=rows, ctx=ctx, block_size=block_size, tree=tree,
                     kv_bytes=kv_bytes)
        calls = [("decode rows", {})] + [("decode rows " + ",".join(f"{k}={v}" for k, v in var.items()), var)
                                         for var in sweep]
        scratch = DecodeScratch()
        for impl, var in calls:
            def call(var=var):
                return paged_decode(q, kc, vc, bt, lens, self.scale, out=out, scratch=scratch, rows_per_seq=rows,
                                    tree_mask=mask, **var)
            self._time_call(shape, impl, call, out, ref, check * rows)
        self._time_call(shape, "prefill", lambda: paged_prefill(q, kc, vc, qsl, lens, bt, rows, self.scale, out=out,
                                                                 tree_mask=mask), out, ref, check * rows)

    def _time_call(self, shape: dict, impl: str, call, out, ref, check_rows: int) -> None:
        try:
            call()
            err = rel_err(out[:check_rows], ref)
            us, method = self.time_us([call] * 10)
            self.add(**shape, impl=impl, us=us, tbps=shape["kv_bytes"] / us / 1e6, rel_err=err, method=method)
        except Exception as e:
            self.add(**shape, impl=impl, error=f"{type(e).__name__}: {e}"[:300])

    # ------------------------------------------------------------ prefill / extend

    def prefill(self, name: str, query_lens: list[int], ctx_lens: list[int], block_size: int, with_fa4: bool,
                configs=(), fp8: bool = False):
        seq_lens = [q + c for q, c in zip(query_lens, ctx_lens)]
        kc, vc, tables = self.paged_kv(seq_lens, block_size, 1, fp8)
        scales = FP8_KV_SCALES if fp8 else {}
        with_fa4 = with_fa4 and not fp8
        bt = tables[0]
        q = torch.randn(sum(query_lens), self.H, self.D, device=self.device, dtype=self.dtype)
        qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(self.device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        maxq = max(query_lens)
        out = torch.full_like(q, float("nan"))
        ref = paged_attention_reference(q, kc, vc, lens, bt, self.scale, query_start_loc=qsl, **scales)
        pairs = sum(ql * c + ql * (ql + 1) // 2 for ql, c in zip(query_lens, ctx_lens))
        flops = 4 * self.H * self.D * pairs
        shape = dict(kind=name, batch=len(query_lens), query_len=maxq, ctx=max(ctx_lens), block_size=block_size,
                     flops=flops, kv="fp8" if fp8 else "model")
        for cfg in [{}] + list(configs):
            try:
                paged_prefill(q, kc, vc, qsl, lens, bt, maxq, self.scale, out=out, **cfg, **scales)
                err = rel_err(out, ref)
                us, method = self.time_us(
                    [lambda: paged_prefill(q, kc, vc, qsl, lens, bt, maxq, self.scale, out=out, **cfg, **scales)] * 10)
                impl = "triton" + ("" if not cfg else " " + ",".join(f"{k}={v}" for k, v in cfg.items()))
                self.add(**shape, impl=impl, us=us, tflops=flops / us / 1e6, rel_err=err, method=method)
            except Exception as e:
                self.add(**shape, impl=f"triton {cfg}", error=f"{type(e).__name__}: {e}"[:300])
        if with_fa4 and self.fa4 is not None:
            try:
                def call():
                    return fa4_prefill(self.fa4, q, kc, vc, bt, qsl, lens, maxq, self.scale)
                err = rel_err(call(), ref)
                us, method = self.time_us([call] * 10, use_graph=self.fa4_graph)
                self.fa4_graph = method == "cuda-graph"
                self.add(**shape, impl="fa4", us=us, tflops=flops / us / 1e6, rel_err=err, method=method)
            except Exception as e:
                self.add(**shape, impl="fa4", error=f"{type(e).__name__}: {e}"[:300])

    # ------------------------------------------------------------ small fused ops and torch references

    def small_ops(self, tokens: int, hidden: int, inter: int):
        dev, dt = self.device, self.dtype
        x = torch.randn(tokens, hidden, device=dev, dtype=dt)
        r = torch.randn(tokens, hidden, device=dev, dtype=dt)
        w = torch.randn(hidden, device=dev, dtype=dt)
        gu = torch.randn(tokens, 2 * inter, device=dev, dtype=dt)
        qkv = torch.randn(tokens, (self.H + 2 * self.KVH) * self.D, device=dev, dtype=dt)
        pos = torch.randint(0, 4096, (tokens,), device=dev)
        freqs = torch.arange(4096, device=dev).float()[:, None] * (1e-4 ** (torch.arange(0, self.D, 2, device=dev)
                                                                          / self.D))[None]
        cos, sin = freqs.cos().to(dt), freqs.sin().to(dt)
        kc = torch.zeros(tokens // 16 + 2, 16, self.KVH, self.D, device=dev, dtype=dt)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(kc.shape[0] * 16, device=dev)[:tokens]
        qw, kw = torch.rand(self.D, device=dev, dtype=dt) + 0.5, torch.rand(self.D, device=dev, dtype=dt) + 0.5
        heads = (self.H, self.KVH, self.D)

        def qk_store(store=qk_norm_rope_store, caches=(kc, vc)):
            return store(qkv, pos, slots, qw, kw, cos, sin, 1e-6, *heads, *caches)
        e = dt.itemsize
        ops = [
            ("rmsnorm+residual", lambda: rmsnorm(x, w, 1e-6, r), lambda: rmsnorm_reference(x, w, 1e-6, r),
             5 * tokens * hidden * e),
            ("silu_mul", lambda: silu_mul(gu), lambda: silu_mul_reference(gu), 3 * tokens * inter * e),
            ("qk norm+rotary+store", qk_store, lambda: qk_store(qk_norm_rope_store_reference),
             2 * tokens * (self.H + 2 * self.KVH) * self.D * e),
        ]
        checks = {
            "rmsnorm+residual": lambda: max(rel_err(a, b) for a, b in zip(rmsnorm(x, w, 1e-6, r),
                                                                          rmsnorm_reference(x, w, 1e-6, r))),
            "silu_mul": lambda: rel_err(silu_mul(gu), silu_mul_reference(gu)),
            "qk norm+rotary+store": lambda: check_qk_store(qk_store, kc, vc),
        }
        for name, fast, ref, nbytes in ops:
            try:
                err = checks[name]()
                us, method = self.time_us([fast] * 20)
                self.add(kind=name, tokens=tokens, impl="triton", us=us, tbps=nbytes / us / 1e6, rel_err=err,
                         method=method)
                us, method = self.time_us([ref] * 20, use_graph=False)
                self.add(kind=name, tokens=tokens, impl="torch eager", us=us, tbps=nbytes / us / 1e6,
                         method=method)
            except Exception as e:
                self.add(kind=name, tokens=tokens, impl="triton", error=f"{type(e).__name__}: {e}"[:300])

    def torch_reference_attention(self):
        """The host-looping torch reference at a few small shapes, wall clock (it syncs by design)."""
        for batch, ctx in ((1, 512), (8, 1024)):
            kc, vc, tables = self.paged_kv([ctx] * batch, 16, 1)
            lens = torch.tensor([ctx] * batch, dtype=torch.int32, device=self.device)
            q = torch.randn(batch, self.H, self.D, device=self.device, dtype=self.dtype)
            us = self.wall_us(lambda: paged_attention_reference(q, kc, vc, lens, tables[0], self.scale))
            kv_bytes = batch * ctx * self.KVH * self.D * 2 * self.dtype.itemsize
            self.add(kind="decode", batch=batch, ctx=ctx, block_size=16, impl="torch reference", us=us,
                     tbps=kv_bytes / us / 1e6, method="wall")
        ql = 512
        kc, vc, tables = self.paged_kv([ql], 16, 1)
        q = torch.randn(ql, self.H, self.D, device=self.device, dtype=self.dtype)
        qsl = torch.tensor([0, ql], dtype=torch.int32, device=self.device)
        lens = torch.tensor([ql], dtype=torch.int32, device=self.device)
        us = self.wall_us(lambda: paged_attention_reference(q, kc, vc, lens, tables[0], self.scale,
                                                            query_start_loc=qsl))
        flops = 4 * self.H * self.D * ql * (ql + 1) // 2
        self.add(kind="prefill", batch=1, query_len=ql, ctx=0, block_size=16, impl="torch reference", us=us,
                 tflops=flops / us / 1e6, method="wall")

    def wall_us(self, fn, reps: int = 5) -> float:
        fn()
        self.sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


# ---------------------------------------------------------------- FlashAttention-4

def load_fa4():
    from llmserve_core.layers.attention.flash_attn_backend import load_fa4 as load
    try:
        return load()
    except Exception as e:  # not installed, or its runtime does not load here
        print(f"FA4 not available: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def fa4_decode(fn, q, kc, vc, bt, lens, scale, num_splits):
    """Decode through FA4's paged path: q as [B, 1, H, D], lengths from seqused_k."""
    return _first(fn(q.unsqueeze(1), kc, vc, seqused_k=lens, page_table=bt, softmax_scale=scale, causal=True,
                     num_splits=num_splits)).squeeze(1)


def fa4_prefill(fn, q, kc, vc, bt, qsl, lens, maxq, scale):
    return _first(fn(q, kc, vc, cu_seqlens_q=qsl, seqused_k=lens, page_table=bt, max_seqlen_q=maxq,
                     softmax_scale=scale, causal=True))


def engine_takes_fa4(max_query_len: int) -> bool:
    """The triton-fa4 backend's own predicate at the benchmark's dtype and head size (no tree mask)."""
    from types import SimpleNamespace

    from llmserve_core.layers.attention.triton_fa4_backend import use_fa4
    batch = SimpleNamespace(tree_mask=None, uniform_query_len=0, max_query_len=max_query_len)
    return use_fa4(torch.bfloat16, 128, batch, False)


# ---------------------------------------------------------------- checks

def rel_err(out, ref) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def check_qk_store(qk_store, kc, vc):
    """Worst relative error of q and the stored K/V, fused kernel against the torch composition."""
    a, b, ra, rb = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = qk_store(caches=(a, b))
    qr = qk_store(qk_norm_rope_store_reference, caches=(ra, rb))
    return max(rel_err(q, qr), rel_err(a, ra), rel_err(b, rb))


# ---------------------------------------------------------------- report

def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def grouped(rows: list[dict], key) -> list[tuple[tuple, list[dict]]]:
    """(key, its rows) for each distinct key(row), keys sorted."""
    return [(k, [r for r in rows if key(r) == k]) for k in sorted({key(r) for r in rows})]


def table(rows: list[dict]) -> str:
    """Decode: triton vs FA4 per shape. Prefill: same. Then everything else, one line each."""
    lines = []
    dec = [r for r in rows if r["kind"] == "decode" and "us" in r and r["impl"] != "torch reference"]
    if dec:
        lines += ["| decode B | ctx | page | KV | triton us | TB/s | splits | best variant us | FA4 us | FA4 TB/s | "
                  "FA4/triton | err |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, rs in grouped(dec, lambda r: (r["batch"], r["ctx"], r["block_size"], r.get("kv", "model"))):
            t = next((r for r in rs if r["impl"] == "triton"), None)
            f = next((r for r in rs if r["impl"] == "fa4 num_splits=1"), None)
            best = min((r for r in rs if r["impl"].startswith("triton")), key=lambda r: r["us"], default=None)
            if t is None:
                continue
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {t['us']:.1f} | {t['tbps']:.2f} | "
                         f"{t['num_splits']} | "
                         f"{best['us']:.1f} ({best['impl'].replace('triton ', '') or 'default'}) | "
                         f"{fmt(f and f['us'], '.1f')} | {fmt(f and f['tbps'], '.2f')} | "
                         f"{fmt(f and f['us'] / t['us'], '.2f')} | {t['rel_err']:.1e} |")
    pre = [r for r in rows if r["kind"] in ("prefill", "extend") and "us" in r and r["impl"] != "torch reference"]
    if pre:
        lines += ["", "| shape | page | KV | triton us | TFLOP/s | best variant us | FA4 us | FA4 TFLOP/s | FA4/triton | "
                  "engine path | engine speed / FA4 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, rs in grouped(pre, lambda r: (r["kind"], r["batch"], r["query_len"], r["ctx"], r["block_size"],
                                               r.get("kv", "model"))):
            t = next((r for r in rs if r["impl"] == "triton"), None)
            f = next((r for r in rs if r["impl"] == "fa4"), None)
            best = min((r for r in rs if r["impl"].startswith("triton")), key=lambda r: r["us"], default=None)
            if t is None:
                continue
            name = f"{key[0]} {key[1]}x{key[2]}" + (f" over {key[3]}" if key[3] else "")
            # What --attention-backend auto (triton-fa4) runs at this shape, and its speed relative to FA4.
            path = f if (f is not None and engine_takes_fa4(key[2])) else t
            lines.append(f"| {name} | {key[4]} | {key[5]} | {t['us']:.1f} | {t['tflops']:.0f} | "
                         f"{best['us']:.1f} ({best['impl']}) | {fmt(f and f['us'], '.1f')} | "
                         f"{fmt(f and f['tflops'], '.0f')} | {fmt(f and f['us'] / t['us'], '.2f')} | "
                         f"{'fa4' if path is f else 'triton'} | {fmt(f and f['us'] / path['us'], '.2f')} |")
    ver = [r for r in rows if r["kind"] == "verify" and "us" in r]
    if ver:
        lines += ["", "| verify B x rows | ctx | page | mask | decode rows us | TB/s | best variant us | prefill us | "
                  "err |", "|---|---|---|---|---|---|---|---|---|"]
        for key, rs in grouped(ver, lambda r: (r["batch"], r["query_len"], r["ctx"], r["block_size"], r["tree"])):
            t = next((r for r in rs if r["impl"] == "decode rows"), None)
            p = next((r for r in rs if r["impl"] == "prefill"), None)
            best = min(rs, key=lambda r: r["us"])
            if t is None:
                continue
            lines.append(f"| {key[0]} x {key[1]} | {key[2]} | {key[3]} | {'tree' if key[4] else 'causal'} | "
                         f"{t['us']:.1f} | {t['tbps']:.2f} | {best['us']:.1f} ({best['impl']}) | "
                         f"{fmt(p and p['us'], '.1f')} | {max(r['rel_err'] for r in rs):.1e} |")
    other = [r for r in rows if r not in dec and r not in pre and r not in ver]
    if other:
        lines += ["", "| other | impl | us | rate | err | method |", "|---|---|---|---|---|---|"]
        for r in other:
            shape = " ".join(f"{k}={r[k]}" for k in ("batch", "ctx", "query_len", "tokens", "block_size") if k in r)
            rate = (f"{r['tbps']:.2f} TB/s" if "tbps" in r else f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r
                    else "")
            lines.append(f"| {r['kind']} {shape} | {r['impl']} | {fmt(r.get('us'), '.1f')} | {rate} | "
                         f"{fmt(r.get('rel_err'), '.1e')} | {r.get('method', r.get('error', ''))} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--budget-s", type=float, default=240, help="stop starting new shapes after this long")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    ap.add_argument("--commit", default="", help="git commit the numbers belong to")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only prefill / extend shapes, Triton against FA4 (skips decode and small ops)")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="only decode at batch 64 and 256 (512 and 640 keys, the step benchmarks' contexts), "
                         "the default tiles against a sweep of splits, key tiles, warps and stages")
    ap.add_argument("--decode-after-gemm", action="store_true",
                    help="only the decode at batch 64 and 256 (513 keys, and 588: decode_profile's profiled "
                         "steps at --ctx 512) alone, a qkv-shaped GEMM alone, and the two alternating: the "
                         "decode's time right after a GEMM, as a step runs it")
    ap.add_argument("--fp8-kv", action="store_true",
                    help="only decode, extend and prefill over FP8 (e4m3) caches beside the model-dtype cache "
                         "at the same shapes, with sweeps of FP8 decode and prefill tiles")
    ap.add_argument("--verify-only", action="store_true",
                    help="only speculative verify shapes (rows per sequence, causal and tree-masked), the "
                         "decode kernel's rows path in several tile configs against the prefill kernel")
    args = ap.parse_args()
    b = Bench(args.out_dir, args.budget_s, args.smoke)
    b.meta["commit"] = args.commit
    t_start = time.time()

    def step(label, fn, *a, **kw):
        if b.time_left() <= 0:
            b.add(kind="skipped", impl=label, error="time budget spent")
            return
        t0 = time.time()
        try:
            fn(*a, **kw)
        except Exception as e:
            traceback.print_exc()
            b.add(kind="error", impl=label, error=f"{type(e).__name__}: {e}"[:300])
        print(f"[{time.time() - t_start:6.1f}s] {label} ({time.time() - t0:.1f}s)", flush=True)

    if args.smoke:
        step("decode", b.decode, 2, 40, 16, True, sweep=[dict(num_splits=4, block_n=16)])
        step("decode after gemm", b.decode_after_gemm, 3, 40, 16)
        step("verify", b.verify, 2, 4, 30, 16, True, sweep=[dict(num_warps=2)])
        step("prefill", b.prefill, "prefill", [20, 7], [0, 0], 16, True, configs=[dict(block_m=16, block_n=16)])
        step("extend", b.prefill, "extend", [9, 5], [30, 12], 4, True)
        step("small ops", b.small_ops, 8, 64, 96)
        step("torch reference", b.torch_reference_attention)
    elif args.decode_sweep:
        def dv(s, bn, w=4, st=2):
            return dict(num_splits=s, block_n=bn, num_warps=w, num_stages=st)
        tiles = {64: [dv(1, 64), dv(2, 64), dv(4, 64), dv(4, 32), dv(8, 32), dv(1, 64, 4, 3), dv(1, 32, 4, 3),
                      dv(1, 64, 4, 4), dv(2, 64, 4, 3), dv(2, 32, 4, 3), dv(1, 128, 8), dv(2, 64, 8, 3),
                      dv(1, 32, 2, 3), dv(2, 32, 2, 3), dv(4, 32, 2, 2)],
                 256: [dv(1, 64, 4, 3), dv(1, 64, 4, 4), dv(1, 32, 4, 3), dv(1, 128, 8), dv(1, 64, 8, 3),
                       dv(2, 64), dv(1, 32, 2, 3), dv(1, 64, 2, 3)]}
        for batch in (64, 256):
            for ctx in (512, 640):
                step(f"decode b{batch} {ctx} p16", b.decode, batch, ctx, 16, False, sweep=tiles[batch])
    elif args.decode_after_gemm:
        for batch in (256, 64):
            for ctx in (513, 588):
                step(f"decode after gemm b{batch} {ctx}", b.decode_after_gemm, batch, ctx)
    elif args.fp8_kv:
        def dv(bn, w=4, st=3):
            return dict(num_splits=1, block_n=bn, num_warps=w, num_stages=st)
        # An e4m3 tile holds half the bytes of a bf16 one with as many keys: longer key tiles for the same bytes.
        fp8_tiles = [dv(64, 4, 3), dv(64, 4, 4), dv(128, 2, 2), dv(128, 2, 3), dv(128, 4, 2), dv(128, 4, 3),
                     dv(128, 4, 4), dv(128, 8, 3), dv(256, 4, 2), dv(256, 8, 2), dv(256, 8, 3)]
        for batch, ctx in ((1, 4096), (64, 512), (64, 4096), (256, 512), (256, 2048)):
            step(f"decode b{batch} {ctx} p16", b.decode, batch, ctx, 16, False)
            step(f"decode b{batch} {ctx} p16 fp8", b.decode, batch, ctx, 16, False, fp8=True,
                 sweep=fp8_tiles if batch >= 64 else [dict(block_n=128), dict(block_n=128, num_warps=8)])
        # The prefill tiles were chosen for 16-bit caches; an e4m3 K/V tile of as many keys is half the shared
        # memory, so deeper pipelines and longer key tiles fit too.
        fp8_prefill = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                       for bm, bn, w, st in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3),
                                             (64, 64, 4, 3), (64, 64, 4, 4), (128, 256, 8, 2))]
        for fp8 in (False, True):
            step(f"extend 4x1024+2048 p16{' fp8' * fp8}", b.prefill, "extend", [1024] * 4, [2048] * 4, 16, False,
                 configs=fp8_prefill if fp8 else (), fp8=fp8)
            step(f"prefill 8x512 p16{' fp8' * fp8}", b.prefill, "prefill", [512] * 8, [0] * 8, 16, False,
                 configs=fp8_prefill if fp8 else (), fp8=fp8)
    elif args.verify_only:
        # Chain verifies (4 rows), static trees (~10), dynamic trees (32): GROUP 4 makes 16-128 tile rows.
        # The merge of a split's pieces grows with the rows, so fewer, longer pieces may pay for verifies.
        tiles = [dict(num_warps=w, block_n=bn) for w in (4, 8) for bn in (32, 64)]
        for batch in (1, 16, 64):
            splits = [dict(num_splits=s) for s in ((4, 8, 16) if batch == 1 else (2, 4) if batch == 16 else ())]
            for rows, tree in ((4, False), (8, True), (16, True), (32, True)):
                step(f"verify b{batch} x{rows}", b.verify, batch, rows, 512, 16, tree, sweep=tiles + splits)
    else:
        # Most important first, so a short budget still answers the questions that matter.
        def dv(s, bn, w=4, st=2):
            return dict(num_splits=s, block_n=bn, num_warps=w, num_stages=st)
        if not args.prefill_only:     # the first-answered decode shapes
            step("decode b1 4096 p128", b.decode, 1, 4096, 128, True,
                 sweep=[dv(64, 32), dv(64, 64), dv(128, 32, 2), dv(256, 16), dv(128, 32, 4, 3)])
            step("decode b1 4096 p16", b.decode, 1, 4096, 16, True, sweep=[dv(64, 64)])
            step("decode b8 4096 p128", b.decode, 8, 4096, 128, True,
                 sweep=[dv(8, 64), dv(32, 32), dv(16, 64, 4, 3)])
            step("decode b64 1024 p128", b.decode, 64, 1024, 128, True,
                 sweep=[dv(2, 64), dv(1, 128, 8), dv(1, 64, 4, 3), dv(1, 32, 4, 3)])
            step("decode b64 1024 p16", b.decode, 64, 1024, 16, True)
            step("decode b64 4096 p128", b.decode, 64, 4096, 128, True,
                 sweep=[dv(1, 128, 8), dv(1, 64, 4, 3), dv(1, 128, 4, 3), dv(1, 64, 8, 3)])
            step("decode b256 1024 p128", b.decode, 256, 1024, 128, True, sweep=[dv(1, 128, 8), dv(1, 64, 4, 3)])
            step("decode b256 4096 p128", b.decode, 256, 4096, 128, True, sweep=[dv(1, 128, 8), dv(1, 64, 4, 3)])
        prefill_cfgs = [dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
                        dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
                        dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
                        dict(block_m=64, block_n=128, num_warps=4, num_stages=2)]
        step("prefill 8x512 p128", b.prefill, "prefill", [512] * 8, [0] * 8, 128, True, configs=prefill_cfgs)
        step("extend 4x1024+2048 p128", b.prefill, "extend", [1024] * 4, [2048] * 4, 128, True,
             configs=prefill_cfgs)
        step("extend 4x1024+1024 p128", b.prefill, "extend", [1024] * 4, [1024] * 4, 128, True)
        step("prefill 8x512 p16", b.prefill, "prefill", [512] * 8, [0] * 8, 16, True)
        step("extend 4x1024+2048 p16", b.prefill, "extend", [1024] * 4, [2048] * 4, 16, True)
        # Short extends (a few new rows per sequence over a context; a speculative verify instead takes the
        # decode kernel's rows path): which kernel is faster decides FA4_MIN_QUERY_LEN in triton_fa4_backend.py.
        for batch in (1, 8, 64):
            for ql in (4, 8, 16, 32):
                step(f"short extend {batch}x{ql}+640 p16", b.prefill, "extend", [ql] * batch, [640] * batch, 16, True)
        if args.prefill_only:
            b.meta["wall_s"] = time.time() - t_start
            return finish(b, args)
        done = {(1, 4096, 128), (1, 4096, 16), (8, 4096, 128), (64, 1024, 128), (64, 1024, 16), (64, 4096, 128),
                (256, 1024, 128), (256, 4096, 128)}
        for batch in (1, 8, 64, 256):
            for ctx in (512, 1024, 2048, 4096, 8192):
                for bs in (128, 16):
                    if (batch, ctx, bs) not in done:
                        step(f"decode b{batch} {ctx} p{bs}", b.decode, batch, ctx, bs, False)
        step("small ops", b.small_ops, 256, 4096, 12288)
        step("torch reference", b.torch_reference_attention)

    b.meta["wall_s"] = time.time() - t_start
    finish(b, args)


def finish(b: Bench, args) -> None:
    b.save()
    md = table(b.rows)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(f"# Kernel benchmark\n\n{json.dumps(b.meta)}\n\n{md}\n")
    print(md)


if __name__ == "__main__":
    main()
