"""CUDA graphs for the forwards whose shape is fixed per sequence: plain decode (1 row), the draft's
single-token steps (1 row), the padded draft catch-up, each tree level's draft forward and the verify
forward (1 + gamma rows, or the tree's nodes), one graph per batch bucket.

A small model's step is dozens of short kernels; launching them one by one from Python costs more than
running them. Each bucket's forward is captured once over static device buffers and replayed with fresh
inputs copied in. Batches are padded up to the next bucket with sequences whose rows write no KV
(slot -1) and attend to a few cached slots, so padding never touches live state; the count of live rows
rides along (ForwardBatch.live_rows) for the MoE router, which routes padding rows to no expert. Every length the
kernels read comes from device tensors, and a tree mask is a buffer too, copied in each replay (a
dynamic tree's differs per request and step; padding rows keep an earlier valid mask).

capture=False keeps the static buffers and padding but runs the forward eagerly on every call: the same
bookkeeping without a GPU, which is how the CPU tests check it.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from llmserve_core.engine.batch_builder import ALIGN, HostSpans
from llmserve_core.layers import index_checks
from llmserve_core.layers.batch import ForwardBatch

log = logging.getLogger("llmserve.step_graphs")

# fn(input_ids [T], hidden [T, H] or None, batch) -> tuple of tensors, each with a fixed number of rows per
# sequence (sequence-major): all T rows, or e.g. each sequence's last row only
StepFn = Callable[[torch.Tensor, torch.Tensor | None, ForwardBatch], tuple[torch.Tensor, ...]]


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256, 16)) + list(range(256, 1025, 64))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class StepGraphs:
    def __init__(self, name: str, fn: StepFn, rows: int, max_batch: int, max_blocks_per_seq: int, max_seq_len: int,
                 device, hidden_size: int | None = None, dtype=None, tree_mask: torch.Tensor | None = None,
                 capture: bool = True):
        self.name, self.fn, self.rows = name, fn, rows
        self.buckets = batch_buckets(max_batch)
        self.max_seq_len = max_seq_len
        self.capture = capture
        total = max_batch * rows
        i32, i64 = torch.int32, torch.int64
        # Every per-step integer input lives in one device buffer (block tables last), so a batch built on
        # the host arrives in one copy from a pinned mirror of it (load); `extra` carries a caller's indices,
        # up to two a row (a decode's placeholder rows and the rows of the last step's tokens that fill them).
        sections = [("input_ids", i64, (total,)), ("positions", i64, (total,)), ("slot_mapping", i64, (total,)),
                    ("extra", i64, (2 * total,)), ("seq_lens", i32, (max_batch,)), ("live_rows", i32, (1,)),
                    ("block_tables", i32, (max_batch, max_blocks_per_seq))]
        self._offsets, nbytes = {}, 0
        for section, kind, shape in sections:
            self._offsets[section] = nbytes
            nbytes += -(-torch.Size(shape).numel() * kind.itemsize // ALIGN) * ALIGN
        self.inputs = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._sections = sections
        for section, _, _ in sections:
            setattr(self, section, self._view(self.inputs, section))
        self._mirrors: list[torch.Tensor] = []      # pinned host copies of `inputs`, made on the first load
        self._mirror_views: list[dict[str, np.ndarray]] = []
        self._mirror_done: list[torch.cuda.Event | None] = [None, None]
        self._loads = 0
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(rows)
        self.live_rows.fill_(total)
        self.query_start_loc = torch.arange(0, (max_batch + 1) * rows, rows, dtype=i32, device=device)
        self.hidden = torch.zeros(total, hidden_size, dtype=dtype, device=device) if hidden_size else None
        self.tree_mask = tree_mask.to(device).repeat(max_batch, 1) if tree_mask is not None else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.replays = 0
        self.last_bucket = 0        # the bucket of the last run (benchmarks replay it alone)
        self.index_limits: index_checks.IndexLimits | None = None   # what the inputs must stay inside (the runner's)
        if capture:
            self._capture_all()

    def _view(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        _, dtype, shape = next(sec for sec in self._sections if sec[0] == name)
        off = self._offsets[name]
        return raw[off:off + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)

    def _batch(self, n: int) -> ForwardBatch:
        # max_seq_len is the static worst case: a graph must not depend on this step's lengths.
        t = n * self.rows
        return ForwardBatch(self.positions[:t], self.slot_mapping[:t], self.query_start_loc[:n + 1], self.seq_lens[:n],
                            self.block_tables[:n], max_query_len=self.rows, max_seq_len=self.max_seq_len,
                            tree_mask=self.tree_mask[:t] if self.tree_mask is not None else None,
                            uniform_query_len=self.rows, live_rows=self.live_rows)

    def _call(self, n: int) -> tuple[torch.Tensor, ...]:
        t = n * self.rows
        return self.fn(self.input_ids[:t], self.hidden[:t] if self.hidden is not None else None, self._batch(n))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for n in reversed(self.buckets):          # largest first, so smaller graphs reuse its memory pool
            for _ in range(2):                    # warm up: Triton compiles and autotunes outside capture
                self._call(n)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._call(n)
            pool = graph.pool()
            self.graphs[n] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured %s CUDA graphs for batch sizes %s", self.name, self.buckets)

    def release(self) -> None:
        """Free the captured graphs (and what they captured); the bucket cannot be replayed afterwards."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is this graph's shape: `rows` query rows per sequence, within the largest bucket."""
        return batch.uniform_query_len == self.rows and self.bucket_for(batch.num_seqs) is not None

    def load(self, spans: HostSpans, extra: np.ndarray | None = None) -> int:
        """Fill the static inputs from a batch built on the host (BatchBuilder.finish_host, `rows` rows per
        sequence, ids included), graph padding too, in one host-to-device copy; `extra` (int64 indices)
        lands in self.extra. Returns the number of sequences, for replay()."""
        n, t = len(spans.query_lens), len(spans.positions)
        assert t == n * self.rows and spans.input_ids is not None, "load: rows per sequence or ids missing"
        bucket = self.bucket_for(n)
        if not self._mirrors:                  # two, alternating, so one can fill while the other copies
            pin = self.inputs.is_cuda
            self._mirrors = [torch.zeros_like(self.inputs, device="cpu", pin_memory=pin) for _ in range(2)]
            self._mirror_views = [{name: self._view(m, name).numpy() for name, _, _ in self._sections}
                                  for m in self._mirrors]
        which = self._loads % 2
        self._loads += 1
        if self._mirror_done[which] is not None:
            self._mirror_done[which].synchronize()       # its last copy must be done before it is rewritten
        m = self._mirror_views[which]
        m["input_ids"][:t] = spans.input_ids
        m["input_ids"][t:bucket * self.rows] = 0         # a padding row's id is read: never a PLACEHOLDER (-1)
        m["positions"][:t] = spans.positions
        m["slot_mapping"][:t] = spans.slots
        m["slot_mapping"][t:bucket * self.rows] = -1
        m["seq_lens"][:n] = spans.seq_lens
        m["seq_lens"][n:bucket] = self.rows
        m["live_rows"][0] = t
        width = spans.block_tables.shape[1]
        m["block_tables"][:n, :width] = spans.block_tables
        if extra is not None:
            m["extra"][:len(extra)] = extra
        end = self._offsets["block_tables"] + bucket * self.block_tables.shape[1] * 4
        src = self._mirrors[which][:end]
        if self.inputs.is_cuda:
            self.inputs[:end].copy_(src, non_blocking=True)
            self._mirror_done[which] = torch.cuda.Event()
            self._mirror_done[which].record()
        else:
            self.inputs[:end].copy_(src)
        return n

    def replay(self, n: int) -> tuple[torch.Tensor, ...]:
        """Run the bucket of n sequences over the static inputs as they are; outputs cut to the n live
        sequences' rows (padding sequences come last)."""
        bucket = self.bucket_for(n)
        if index_checks.ENABLED and self.index_limits is not None:
            index_checks.check_batch(f"the {self.name} graph's inputs ({n} sequences, padded to {bucket})",
                                     self.index_limits, self._batch(bucket), self.input_ids[:bucket * self.rows],
                                     names=[f"graph padding {i - n}" if i >= n else f"#{i}" for i in range(bucket)])
        self.replays += 1
        self.last_bucket = bucket
        if self.capture:
            graph, out = self.graphs[bucket]
            graph.replay()
        else:
            out = self._call(bucket)
        return tuple(o[:o.shape[0] // bucket * n] for o in out)

    def run(self, input_ids: torch.Tensor, hidden: torch.Tensor | None, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """Replay for a batch of n sequences with `rows` query rows each; outputs cut to the n live sequences'
        rows (padding sequences come last)."""
        n, t = batch.num_seqs, batch.num_tokens
        bucket = self.bucket_for(n)
        padded = bucket * self.rows
        width = batch.block_tables.shape[1]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slot_mapping[:t].copy_(batch.slot_mapping)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        if hidden is not None:
            self.hidden[:t].copy_(hidden)
        if self.tree_mask is not None:
            self.tree_mask[:t].copy_(batch.tree_mask)
        if bucket > n:
            # A padding row's id is read too: what an earlier load left there may be a PLACEHOLDER (-1).
            self.input_ids[t:padded].zero_()
            self.slot_mapping[t:padded].fill_(-1)
            self.seq_lens[n:bucket].fill_(self.rows)
        self.live_rows.fill_(t)
        return self.replay(n)
