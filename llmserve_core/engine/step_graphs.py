"""CUDA graphs for the forwards whose shape is fixed per sequence: plain decode (1 row), the draft's
single-token steps (1 row), the padded draft catch-up, each tree level's draft forward and the verify
forward (1 + gamma rows, or the tree's nodes), one graph per batch bucket.

A small model's step is dozens of short kernels; launching them one by one from Python costs more than
running them. Each bucket's forward is captured once over static device buffers and replayed with fresh
inputs copied in. Batches are padded up to the next bucket with sequences whose rows write no KV
(slot -1) and attend to a few cached slots, so padding never touches live state. Every length the
kernels read comes from device tensors, and a tree mask is a buffer too, copied in each replay (a
dynamic tree's differs per request and step; padding rows keep an earlier valid mask).

capture=False keeps the static buffers and padding but runs the forward eagerly on every call: the same
bookkeeping without a GPU, which is how the CPU tests check it.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

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
        self.input_ids = torch.zeros(total, dtype=i64, device=device)
        self.positions = torch.zeros(total, dtype=i64, device=device)
        self.slot_mapping = torch.full((total,), -1, dtype=i64, device=device)
        self.seq_lens = torch.full((max_batch,), rows, dtype=i32, device=device)
        self.query_start_loc = torch.arange(0, (max_batch + 1) * rows, rows, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=i32, device=device)
        self.hidden = torch.zeros(total, hidden_size, dtype=dtype, device=device) if hidden_size else None
        self.tree_mask = tree_mask.to(device).repeat(max_batch, 1) if tree_mask is not None else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.replays = 0
        self.last_bucket = 0        # the bucket of the last run (benchmarks replay it alone)
        if capture:
            self._capture_all()

    def _batch(self, n: int) -> ForwardBatch:
        # max_seq_len is the static worst case: a graph must not depend on this step's lengths.
        t = n * self.rows
        return ForwardBatch(self.positions[:t], self.slot_mapping[:t], self.query_start_loc[:n + 1], self.seq_lens[:n],
                            self.block_tables[:n], max_query_len=self.rows, max_seq_len=self.max_seq_len,
                            tree_mask=self.tree_mask[:t] if self.tree_mask is not None else None,
                            uniform_query_len=self.rows)

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

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is this graph's shape: `rows` query rows per sequence, within the largest bucket."""
        return batch.uniform_query_len == self.rows and self.bucket_for(batch.num_seqs) is not None

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
            self.slot_mapping[t:padded].fill_(-1)
            self.seq_lens[n:bucket].fill_(self.rows)
        self.replays += 1
        self.last_bucket = bucket
        if self.capture:
            graph, out = self.graphs[bucket]
            graph.replay()
        else:
            out = self._call(bucket)
        return tuple(o[:o.shape[0] // bucket * n] for o in out)
