"""The once-per-forward broadcast from the core (rank 0) to its workers, with no pickling.

A message is one fixed-size int64 header over the gloo `step_group` (the op, the sizes, and the host-side
lengths the attention backends read, so no worker ever copies them back from its device), then at most
one packed tensor over the `model_group` (NCCL on GPUs: it stays on the device).

A forward that rank 0 runs through one of its step graphs (ModelRunner.mirrored) names that graph in the
header: the worker loads the same inputs into its own copy and replays the same bucket, so the
all-reduces captured in the two graphs meet.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from llmserve_core.layers.batch import ForwardBatch

FORWARD, LOGITS, STOP, COMPACT = 1, 2, 3, 4


def _even_len(n: int) -> int:
    return n + n % 2


def _even(part: torch.Tensor) -> torch.Tensor:
    """A payload part padded to an even number of int64s, so the next part starts 16 bytes in: Triton
    compiles a kernel variant per pointer alignment, and the workers' kernels read these parts in place."""
    return torch.cat([part, part.new_zeros(1)]) if part.numel() % 2 else part


# op, T, B, W, max_query_len, max_seq_len, uniform_query_len, has_tree_mask, num_aux, payload numel, graph + 1
# (0: run the model eagerly)
_FIXED = 11
MAX_AUX = 8


class StepChannel:
    def __init__(self, tp, max_seqs: int):
        self.tp = tp
        self.header = torch.zeros(_FIXED + MAX_AUX + 2 * max_seqs, dtype=torch.int64)
        self.max_seqs = max_seqs

    # ---- rank 0 ----------------------------------------------------------------------------------
    def send_forward(self, input_ids: torch.Tensor, batch: ForwardBatch, aux_layer_ids=(), graph: int | None = None) -> None:
        """graph: the index of the step graphs (ModelRunner.mirrored) rank 0 replays this forward through."""
        b = batch.num_seqs
        if b > self.max_seqs or len(aux_layer_ids) > MAX_AUX:
            raise ValueError(f"step broadcast: {b} sequences exceed the {self.max_seqs} it was sized for")
        parts = [_even(p.to(torch.int64)) for p in (input_ids, batch.positions, batch.slot_mapping,
                                                    batch.query_start_loc, batch.seq_lens, batch.block_tables.flatten())]
        if batch.tree_mask is not None:            # last: nothing follows it, so it needs no padding
            parts.append(batch.tree_mask.flatten().to(torch.int64))
        payload = torch.cat(parts)
        h = self.header
        h.zero_()
        h[:_FIXED] = torch.tensor([FORWARD, batch.num_tokens, b, batch.block_tables.shape[1], batch.max_query_len,
                                   batch.max_seq_len, batch.uniform_query_len, batch.tree_mask is not None,
                                   len(aux_layer_ids), payload.numel(), 0 if graph is None else graph + 1])
        h[_FIXED:_FIXED + len(aux_layer_ids)] = torch.tensor(aux_layer_ids, dtype=torch.int64)
        at = _FIXED + MAX_AUX
        h[at:at + b] = torch.tensor(batch.query_lens_cpu, dtype=torch.int64)
        h[at + b:at + 2 * b] = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64)
        dist.broadcast(h, 0, group=self.tp.step_group)
        dist.broadcast(payload, 0, group=self.tp.model_group)

    def send_logits(self, hidden: torch.Tensor) -> None:
        self.header.zero_()
        self.header[0], self.header[1] = LOGITS, hidden.shape[0]
        dist.broadcast(self.header, 0, group=self.tp.step_group)
        dist.broadcast(hidden.contiguous(), 0, group=self.tp.model_group)

    def send_compact(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """A tree's KV moves (compact_kv's slots), which every rank applies to its own shard of the pool."""
        self.header.zero_()
        self.header[0], self.header[1] = COMPACT, src_slots.numel()
        dist.broadcast(self.header, 0, group=self.tp.step_group)
        dist.broadcast(torch.cat([src_slots, dst_slots]).to(torch.int64), 0, group=self.tp.model_group)

    def send_stop(self) -> None:
        self.header.zero_()
        self.header[0] = STOP
        dist.broadcast(self.header, 0, group=self.tp.step_group)

    # ---- workers ---------------------------------------------------------------------------------
    def recv(self, hidden_size: int, dtype: torch.dtype):
        """-> (op, args): FORWARD (input_ids, ForwardBatch, aux_layer_ids, graph index or None), LOGITS
        (hidden,), COMPACT (src slots, dst slots), STOP ()."""
        h = self.header
        dist.broadcast(h, 0, group=self.tp.step_group)
        op = int(h[0])
        dev = self.tp.device
        if op == LOGITS:
            hidden = torch.empty(int(h[1]), hidden_size, dtype=dtype, device=dev)
            dist.broadcast(hidden, 0, group=self.tp.model_group)
            return op, (hidden,)
        if op == COMPACT:
            slots = torch.empty(2 * int(h[1]), dtype=torch.int64, device=dev)
            dist.broadcast(slots, 0, group=self.tp.model_group)
            return op, tuple(slots.chunk(2))
        if op != FORWARD:
            return op, ()
        t, b, w, max_q, max_s, uniform, has_mask, num_aux, numel, graph = h[1:_FIXED].tolist()
        aux = tuple(h[_FIXED:_FIXED + num_aux].tolist())
        at = _FIXED + MAX_AUX
        query_lens, seq_lens = h[at:at + b].tolist(), h[at + b:at + 2 * b].tolist()
        payload = torch.empty(numel, dtype=torch.int64, device=dev)
        dist.broadcast(payload, 0, group=self.tp.model_group)
        sizes = [t, t, t, b + 1, b, b * w]
        padded = [_even_len(n) for n in sizes]
        parts = payload.split(padded + [numel - sum(padded)])
        ids, positions, slots, qsl, sl, tables = (part[:n] for part, n in zip(parts, sizes))
        rest = parts[-1]
        i32 = torch.int32
        batch = ForwardBatch(positions, slots, qsl.to(i32), sl.to(i32), tables.view(b, w).to(i32), max_query_len=max_q,
                             max_seq_len=max_s, query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
                             tree_mask=rest.view(t, -1).bool() if has_mask else None, uniform_query_len=uniform)
        return op, (ids, batch, aux, graph - 1 if graph else None)
