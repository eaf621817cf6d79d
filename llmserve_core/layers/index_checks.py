"""Index checks for debugging (LLMSERVE_CHECK_INDICES=1): every forward's indices validated on the host.

A bad block id, KV slot, rotary position, sequence length or token id reaches the GPU as an out-of-bounds
access: a device-side assert that names no request and leaves the process's CUDA context unusable, or a
silent read or write of another request's KV. With the checks on, each batch is validated before it is
launched, and the first fault raises IndexCheckError naming the forward, the request (or the sequence)
and the field, on the host and on the CPU alike; the engine then drops that step's requests and serves on.

Where the checks run (each site costs one branch when they are off):
- engine/batch_builder.py, as every host-built batch is finished: block tables, slots, positions, lengths
  and ids against the KV pool, the rotary table and the vocabulary, naming each span's request;
- engine/step_graphs.py, before every CUDA-graph replay: the static inputs of every sequence of the bucket,
  the graph's padding sequences included (a device-to-host copy);
- the models' forwards (not while a graph is being captured): the batch as the kernels will read it,
  device-built batches and ids filled on the device included (a device-to-host copy);
- engine/model_runner.py: the rows a step fills from the previous step's tokens, and the sampled tokens.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

ENABLED = os.environ.get("LLMSERVE_CHECK_INDICES", "0") not in ("", "0")
PLACEHOLDER = -1        # engine/request.py's: an id the device fills from the previous step's tokens


class IndexCheckError(RuntimeError):
    """A forward's indices would reach outside what they index; the message names the request and field."""


@dataclass
class IndexLimits:
    """What a forward's indices must stay inside."""
    num_blocks: int              # the KV pool's blocks
    block_size: int
    max_positions: int           # rows of the rotary table
    vocab_size: int              # rows of the embedding (0: not checked)
    requests: object = None      # the engine's live requests (a dict or list), to name a span's owner

    def owner(self, block_ids) -> str | None:
        """The request whose block list `block_ids` is (the batch builder keeps the caller's list)."""
        if block_ids is None or self.requests is None:
            return None
        reqs = self.requests.values() if isinstance(self.requests, dict) else self.requests
        return next((repr(r.request_id) for r in reqs if r.block_ids is block_ids), None)


def check_spans(where: str, limits: IndexLimits, positions: np.ndarray, slots: np.ndarray, query_lens,
                seq_lens: np.ndarray, tables: np.ndarray, ids: np.ndarray | None = None,
                owners: list | None = None, names: list[str] | None = None, placeholders: bool = True) -> None:
    """Validate a packed batch given as host arrays (layers/batch.py's fields): raise IndexCheckError at the
    first fault. owners: per sequence, the block list its span was built from (its length bounds the table
    row); names: per sequence, what to call it where no owner names it. placeholders: ids may be
    PLACEHOLDER (filled on the device before the forward)."""
    query_lens = [int(n) for n in query_lens]
    b, t = len(query_lens), len(positions)
    if not (len(seq_lens) == b == tables.shape[0]) or sum(query_lens) != t or len(slots) != t:
        raise IndexCheckError(f"index check, {where}: {b} sequences of {t} rows, but seq_lens has {len(seq_lens)}, "
                              f"block_tables {tables.shape[0]} rows, slot_mapping {len(slots)}")
    bs, start = limits.block_size, 0
    for i, q_len in enumerate(query_lens):
        rows = slice(start, start + q_len)
        start += q_len

        def fail(field: str, what: str):
            owned = owners[i] if owners is not None and i < len(owners) else None
            name = limits.owner(owned) or (names[i] if names is not None and i < len(names) else None)
            who = f"request {name}" if name else "a sequence"
            raise IndexCheckError(f"index check, {where}: {who} (sequence {i} of {b}): {field} {what}")

        seq_len = int(seq_lens[i])
        if q_len < 1:
            fail("query_start_loc", f"gives it {q_len} query rows")
        if seq_len < 1:
            fail(f"seq_lens[{i}]", f"= {seq_len}: a sequence holds at least one position")
        need = -(-seq_len // bs)
        if need > tables.shape[1]:
            fail(f"seq_lens[{i}]", f"= {seq_len} needs {need} blocks; its block table row has {tables.shape[1]}")
        if owners is not None and i < len(owners) and owners[i] is not None and need > len(owners[i]):
            fail(f"seq_lens[{i}]", f"= {seq_len} needs {need} blocks; the request holds {len(owners[i])}")
        table = tables[i, :need].astype(np.int64)
        bad = np.flatnonzero((table < 0) | (table >= limits.num_blocks))
        if bad.size:
            j = int(bad[0])
            fail(f"block_tables[{i}][{j}]", f"= {table[j]} is outside the KV pool's {limits.num_blocks} blocks")
        _check_slots(fail, slots[rows], rows.start, table, seq_len, limits)
        pos = positions[rows]
        bad = np.flatnonzero((pos < 0) | (pos >= limits.max_positions))
        if bad.size:
            r = int(bad[0])
            fail(f"positions[{rows.start + r}]", f"= {pos[r]} is outside the rotary table's {limits.max_positions} rows")
        if ids is not None and limits.vocab_size:
            tok = ids[rows]
            ok = (tok >= 0) & (tok < limits.vocab_size)
            if placeholders:
                ok |= tok == PLACEHOLDER
            bad = np.flatnonzero(~ok)
            if bad.size:
                r = int(bad[0])
                fail(f"input_ids[{rows.start + r}]", f"= {tok[r]} is outside the vocabulary [0, {limits.vocab_size})")


def _check_slots(fail, slots: np.ndarray, first_row: int, table: np.ndarray, seq_len: int, limits: IndexLimits):
    """A row writes nothing (-1) or a slot of one of its sequence's blocks, at a position below seq_len."""
    bs = limits.block_size
    for r, slot in enumerate(slots.tolist()):
        if slot == -1:
            continue
        field = f"slot_mapping[{first_row + r}]"
        if not 0 <= slot < limits.num_blocks * bs:
            fail(field, f"= {slot} is outside the KV pool's {limits.num_blocks * bs} slots")
        hit = np.flatnonzero(table == slot // bs)
        if not hit.size:
            fail(field, f"= {slot} is in block {slot // bs}, not one of the sequence's blocks {table.tolist()}")
        if int(hit[0]) * bs + slot % bs >= seq_len:
            fail(field, f"= {slot} is position {int(hit[0]) * bs + slot % bs}, past seq_len {seq_len}")


def check_batch(where: str, limits: IndexLimits, batch, input_ids: torch.Tensor | None = None,
                names: list[str] | None = None) -> None:
    """check_spans over a ForwardBatch on any device (copied to the host: a sync), ids included; here the
    ids are the ones the forward reads, so no placeholder may be left."""
    host = [t.detach().cpu().numpy() for t in (batch.positions, batch.slot_mapping, batch.query_start_loc,
                                                batch.seq_lens, batch.block_tables)]
    ids = input_ids.detach().cpu().numpy() if input_ids is not None else None
    positions, slots, qsl, seq_lens, tables = host
    check_spans(where, limits, positions, slots, np.diff(qsl), seq_lens, tables, ids, names=names,
                placeholders=False)


def check_tokens(where: str, tokens: torch.Tensor, vocab_size: int, names: Iterable[str]) -> None:
    """Token ids a step produced (a sync): each inside the vocabulary, or IndexCheckError naming its request."""
    values = tokens.detach().cpu().tolist()
    for name, tok in zip(names, values):
        if not 0 <= tok < vocab_size:
            raise IndexCheckError(f"index check, {where}: request {name!r}: token id {tok} is outside the "
                                  f"vocabulary [0, {vocab_size})")


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on t's device (no copy to the host may run then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_forward(where: str, batch, input_ids: torch.Tensor, k_cache: torch.Tensor, vocab_size: int,
                  max_positions: int) -> None:
    """A model's forward, against what it indexes: its KV cache [blocks, block_size, ...], embedding rows
    (vocab_size; 0: not checked) and rotary rows. Skipped while a CUDA graph is captured (graph replays are
    checked in engine/step_graphs.py)."""
    if capturing(input_ids):
        return
    check_batch(where, IndexLimits(k_cache.shape[0], k_cache.shape[1], max_positions, vocab_size), batch, input_ids)
