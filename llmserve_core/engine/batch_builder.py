"""Forward batches from per-sequence spans, staged through pinned, double-buffered host memory.

A span is one sequence's query rows in a packed forward: their rotary positions, their KV positions (the
same, except for tree nodes, whose rotary position is their depth; -1 marks a padding row, which writes
no KV), the sequence's context length after the forward, and an optional mask among its own rows (a
tree; None: causal). The model runner's steps and every forward of the speculative executor (catch-up,
draft steps, tree levels, verify) are built here.

Rows are written into growable numpy scratch arrays, then packed into one region of a pinned host arena
and moved to the device in ONE non-blocking copy per batch (the batch's device tensors are views of
it): the host never waits for the GPU and never issues many tiny transfers. Two arenas alternate per
step, and a step's batches take consecutive regions of its arena, so no region is rewritten while the
device may still be copying it (at most one step is in flight). A full arena is replaced by a larger one;
torch's caching host allocator keeps the old block until its pending copies are done.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmserve_core.layers import index_checks
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.speculative.tree import batch_tree_mask

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
ALIGN = 16      # bytes; the alignment Triton specializes pointer arguments on


class _Arena:
    def __init__(self, nbytes: int, pin: bool):
        self.pin = pin
        self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.bytes = self.host.numpy()
        self.used = 0

    def reserve(self, nbytes: int) -> int:
        if self.used + nbytes > self.bytes.size:
            self._allocate(max(2 * self.bytes.size, nbytes))
        start, self.used = self.used, self.used + nbytes
        return start


class HostToDevice:
    """Host int arrays to the device, several in one transfer, through the alternating pinned arenas."""

    def __init__(self, device: torch.device, pin: bool, nbytes: int = 1 << 16):
        self.device = device
        self.arenas = [_Arena(nbytes, pin), _Arena(nbytes, pin)]
        self.arena = self.arenas[0]
        self.num_steps = 0
        # Per arena, an event recorded when a step leaves it: its copies are queued before it. A step that
        # samples nothing is not waited for by the engine, so without it the host could refill an arena
        # whose copies had not run yet (a prefill chunked over many steps).
        self.left: list[torch.cuda.Event | None] = [None, None]

    def new_step(self) -> None:
        """Start a step: switch to the other arena (the one the step before last used), once its copies ran."""
        if self.device.type == "cuda":
            self.left[self.num_steps % 2] = torch.cuda.Event()
            self.left[self.num_steps % 2].record()
        self.num_steps += 1
        i = self.num_steps % 2
        if self.left[i] is not None:
            self.left[i].synchronize()      # long done in steady decoding: the engine read that step back
        self.arena = self.arenas[i]
        self.arena.used = 0

    def copy(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """int32 / int64 arrays -> device tensors of the same shapes, in one non-blocking copy."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            # 16-byte aligned: Triton compiles a kernel variant per pointer alignment (16 bytes or not), so a
            # layout that left one section at 8 would compile a new variant inside a request.
            total += -(-a.nbytes // ALIGN) * ALIGN
        base = self.arena.reserve(total)
        raw = self.arena.bytes
        for a, off in zip(arrays, offsets):
            raw[base + off:base + off + a.nbytes] = a.reshape(-1).view(np.uint8)
        host = self.arena.host[base:base + total]
        dev = host.clone() if self.device.type == "cpu" else host.to(self.device, non_blocking=True)
        return [dev[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]

    def ints(self, values) -> torch.Tensor:
        """One int64 array (a list, a numpy array) to the device."""
        return self.copy([np.asarray(values, dtype=np.int64)])[0]


@dataclass
class BuiltBatch:
    input_ids: torch.Tensor | None     # [T] int64 (None: no span gave ids; the caller brings its own)
    batch: ForwardBatch
    extras: list[torch.Tensor]         # the extra int64 arrays passed to finish(), on the device


@dataclass
class HostSpans:
    """A finished batch's arrays on the host (views of the builder's scratch: read them before its next
    spans are added)."""
    input_ids: np.ndarray | None       # [T] int64
    positions: np.ndarray              # [T] int64 rotary positions
    slots: np.ndarray                  # [T] int64 KV slots (-1: writes nothing)
    seq_lens: np.ndarray               # [B] int32
    block_tables: np.ndarray           # [B, W] int32
    query_lens: list[int]


class BatchBuilder:
    """Pack spans into a ForwardBatch: begin(), add() / add_rows() per sequence, finish()."""

    def __init__(self, block_size: int, max_position: int, staging: HostToDevice, rows: int = 256, seqs: int = 16,
                 max_blocks_per_seq: int = 1):
        self.block_size = block_size
        self.max_position = max_position           # rotary positions are clamped below it
        self.staging = staging
        self.ids = np.zeros(rows, dtype=np.int64)
        self.pos = np.zeros(rows, dtype=np.int64)
        self.slots = np.zeros(rows, dtype=np.int64)
        self.query_start = np.zeros(seqs + 1, dtype=np.int32)
        self.seq_lens = np.zeros(seqs, dtype=np.int32)
        self.tables = np.zeros((seqs, max_blocks_per_seq), dtype=np.int32)
        self.limits: index_checks.IndexLimits | None = None    # set by the runner once the KV pool exists
        self.begin()

    def begin(self) -> None:
        self.t = 0
        self.width = 1
        self.has_ids = False
        self.query_lens: list[int] = []
        self.seq_lens_list: list[int] = []
        self.masks: list[torch.Tensor | None] = []
        self.owners: list[list[int]] = []          # each span's block list, kept only for the index checks

    # ---- spans -----------------------------------------------------------------------------------
    def add(self, block_ids: list[int], start: int, n: int, token_ids=None, seq_len: int | None = None) -> int:
        """n rows at positions start .. start + n - 1 (rotary = KV), causal; token_ids: an int (n == 1) or n
        ids. Returns the span's first row."""
        t = self.t
        self._reserve(t + n, len(self.query_lens) + 1, len(block_ids))
        bs = self.block_size
        if n == 1:                                   # decode: plain ints beat numpy for one row
            self.pos[t] = start
            self.slots[t] = block_ids[start // bs] * bs + start % bs
        else:
            p = np.arange(start, start + n)
            self.pos[t:t + n] = p
            self.slots[t:t + n] = np.asarray(block_ids)[p // bs] * bs + p % bs
        if token_ids is not None:
            self.ids[t:t + n] = token_ids
            self.has_ids = True
        self._close(block_ids, n, start + n if seq_len is None else seq_len, None)
        return t

    def add_rows(self, block_ids: list[int], rope, kv, seq_len: int, token_ids=None,
                 mask: torch.Tensor | None = None) -> int:
        """Rows with explicit rotary and KV positions (kv -1: a padding row that writes nothing) and an
        optional [n, n] mask among them. Returns the span's first row."""
        kv = np.asarray(kv)
        n, t, bs = len(kv), self.t, self.block_size
        self._reserve(t + n, len(self.query_lens) + 1, len(block_ids))
        self.pos[t:t + n] = rope
        self.slots[t:t + n] = np.where(kv >= 0, np.asarray(block_ids)[np.maximum(kv, 0) // bs] * bs + kv % bs, -1)
        if token_ids is not None:
            self.ids[t:t + n] = token_ids
            self.has_ids = True
        self._close(block_ids, n, seq_len, mask)
        return t

    def add_uniform(self, block_ids: list[list[int]], rope: np.ndarray, kv: np.ndarray, seq_lens: np.ndarray,
                    token_ids: np.ndarray) -> int:
        """B spans of W rows each at once, causal (a padded catch-up): rope, kv, token_ids [B, W] as in
        add_rows (kv -1: a padding row that writes nothing), seq_lens [B]. Returns the first span's row."""
        b, w = kv.shape
        t, first = self.t, len(self.query_lens)
        blocks = max(len(ids) for ids in block_ids)
        self._reserve(t + b * w, first + b, blocks)
        tables = self.tables[first:first + b]
        for row, ids in zip(tables, block_ids):
            row[:len(ids)] = ids
        bs = self.block_size
        phys = np.take_along_axis(tables[:, :blocks], np.maximum(kv, 0) // bs, axis=1).astype(np.int64)
        self.pos[t:t + b * w] = rope.reshape(-1)
        self.slots[t:t + b * w] = np.where(kv >= 0, phys * bs + kv % bs, -1).reshape(-1)
        self.ids[t:t + b * w] = token_ids.reshape(-1)
        self.has_ids = True
        self.t += b * w
        self.query_start[first + 1:first + b + 1] = t + w * np.arange(1, b + 1)
        self.seq_lens[first:first + b] = seq_lens
        self.width = max(self.width, blocks)
        self.query_lens += [w] * b
        self.seq_lens_list += seq_lens.tolist()
        self.masks += [None] * b
        if index_checks.ENABLED:
            self.owners += block_ids
        return t

    def _close(self, block_ids: list[int], n: int, seq_len: int, mask) -> None:
        i = len(self.query_lens)
        self.t += n
        self.query_start[i + 1] = self.t
        self.seq_lens[i] = seq_len
        self.tables[i, :len(block_ids)] = block_ids
        self.width = max(self.width, len(block_ids))
        self.query_lens.append(n)
        self.seq_lens_list.append(seq_len)
        self.masks.append(mask)
        if index_checks.ENABLED:
            self.owners.append(block_ids)

    def _reserve(self, rows: int, seqs: int, blocks: int) -> None:
        if rows > self.ids.size:
            size = max(rows, 2 * self.ids.size)
            self.ids, self.pos, self.slots = (np.resize(a, size) for a in (self.ids, self.pos, self.slots))
        if seqs > self.seq_lens.size or blocks > self.tables.shape[1]:
            n, w = max(seqs, 2 * self.seq_lens.size), max(blocks, self.tables.shape[1])
            tables = np.zeros((n, w), dtype=np.int32)
            tables[:self.tables.shape[0], :self.tables.shape[1]] = self.tables
            self.tables = tables
            self.seq_lens = np.resize(self.seq_lens, n)
            self.query_start = np.resize(self.query_start, n + 1)

    # ---- the batch -------------------------------------------------------------------------------
    def finish_host(self) -> "HostSpans":
        """The spans added since begin() as host arrays, for a CUDA graph that loads its static inputs
        itself (StepGraphs.load), with nothing sent to the device here."""
        t, b = self.t, len(self.query_lens)
        np.minimum(self.pos[:t], self.max_position - 1, out=self.pos[:t])
        if index_checks.ENABLED:
            self._check_indices("a CUDA graph's batch")
        spans = HostSpans(self.ids[:t] if self.has_ids else None, self.pos[:t], self.slots[:t], self.seq_lens[:b],
                          self.tables[:b, :self.width], self.query_lens)
        self.begin()
        return spans

    def finish(self, extras: tuple = (), uniform_rows: bool = False) -> BuiltBatch:
        """The ForwardBatch of the spans added since begin(), with `extras` (int64 index arrays the caller
        needs on the device) in the same transfer. uniform_rows: say so when every span has the same
        number of rows (a verify, a padded catch-up, a draft step), so attention may read the KV once per
        sequence as a decode does; plain steps leave prefill chunks to the prefill kernels."""
        t, b = self.t, len(self.query_lens)
        # Rows past the model's positions (drafts of a request about to hit its limit) only feed tokens
        # that will be cut off: clamping their rotary position just keeps the tables in range.
        np.minimum(self.pos[:t], self.max_position - 1, out=self.pos[:t])
        if index_checks.ENABLED:
            self._check_indices("a batch")
        self.query_start[0] = 0
        arrays = [self.pos[:t], self.slots[:t], self.query_start[:b + 1], self.seq_lens[:b], self.tables[:b, :self.width]]
        if self.has_ids:
            arrays.append(self.ids[:t])
        arrays += [np.asarray(e, dtype=np.int64) for e in extras]
        dev = self.staging.copy(arrays)
        positions, slots, query_start, seq_lens, tables = dev[:5]
        input_ids = dev[5] if self.has_ids else None
        query_lens, max_query = self.query_lens, max(self.query_lens)
        mask = None
        if any(m is not None for m in self.masks):
            if all(m is not None and m.shape[0] == max_query for m in self.masks):
                mask = torch.cat(self.masks)             # every span a tree of the same size: no padding
            else:
                mask = batch_tree_mask(query_lens, self.masks, max_query, positions.device)
        batch = ForwardBatch(
            positions=positions, slot_mapping=slots, query_start_loc=query_start, seq_lens=seq_lens,
            block_tables=tables, max_query_len=max_query, max_seq_len=max(self.seq_lens_list),
            query_lens_cpu=query_lens, seq_lens_cpu=self.seq_lens_list, tree_mask=mask,
            uniform_query_len=max_query if (uniform_rows or max_query == 1) and query_lens.count(max_query) == b else 0)
        built = BuiltBatch(input_ids, batch, dev[5 + self.has_ids:])
        self.begin()
        return built

    def _check_indices(self, where: str) -> None:
        """index_checks.check_spans over the spans added since begin(), before anything goes to the device."""
        if self.limits is None:
            return
        t, b = self.t, len(self.query_lens)
        try:
            index_checks.check_spans(where, self.limits, self.pos[:t], self.slots[:t], self.query_lens,
                                     self.seq_lens[:b], self.tables[:b, :self.width],
                                     self.ids[:t] if self.has_ids else None, owners=self.owners)
        except index_checks.IndexCheckError:
            self.begin()            # the next step's batch starts empty
            raise
