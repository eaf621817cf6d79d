"""CUDA graphs for decode steps, one per batch-size bucket.

A decode step of a small model is dozens of short kernels; launching them one by one from Python
costs more than running them. Each bucket's forward is captured once over static device buffers and
replayed with fresh inputs copied in. Batches are padded up to the next bucket with rows that write no
KV (slot -1) and attend to a single cached token, so padding never touches live state.
"""
from __future__ import annotations

import logging

import torch

from llmserve_core.layers.batch import ForwardBatch

log = logging.getLogger("llmserve.cuda_graphs")


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256, 16)) + list(range(256, 1025, 64))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks_per_seq: int, max_model_len: int, device):
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = batch_buckets(max_batch)
        self.max_model_len = max_model_len
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_batch, dtype=i64, device=device)
        self.positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=i32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=i32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture_all()

    def _batch(self, n: int) -> ForwardBatch:
        # max_seq_len is the static worst case: a graph must not depend on this step's lengths.
        return ForwardBatch(self.positions[:n], self.slot_mapping[:n], self.query_start_loc[:n + 1],
                            self.seq_lens[:n], self.block_tables[:n], max_query_len=1,
                            max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for n in reversed(self.buckets):          # largest first, so smaller graphs reuse its memory pool
            batch = self._batch(n)
            for _ in range(2):                    # warm up: Triton compiles and autotunes outside capture
                self.model(self.input_ids[:n], batch, self.kv_caches)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.input_ids[:n], batch, self.kv_caches)
            pool = graph.pool()
            self.graphs[n] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Replay for a decode batch (device tensors, n rows); returns hidden [n, H]."""
        n = batch.num_seqs
        bucket = self.bucket_for(n)
        width = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        if bucket > n:
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].fill_(1)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:n]
