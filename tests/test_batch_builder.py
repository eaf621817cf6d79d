"""The one batch builder (engine/batch_builder.py) and the one graph class (engine/step_graphs.py).

The builder's batches are checked field by field against what attention must see for each kind of span
(prefill chunk, decode row, tree nodes with their mask, padding rows), and a tree span through the model
against each of its root-to-node paths run as plain causal sequences. The graph class's bucket and
padding logic runs eagerly here (capture=False); replay == eager on CUDA is the gpu-marked test below.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve_core import Engine, EngineConfig
from llmserve_core.engine.batch_builder import BatchBuilder, HostToDevice
from llmserve_core.engine.step_graphs import StepGraphs, batch_buckets
from llmserve_core.speculative.tree import batch_tree_mask

BS = 4


def builder(rows=2, seqs=1, blocks=1, max_position=1000) -> BatchBuilder:
    # Tiny initial capacities: every test also exercises the scratch growing.
    return BatchBuilder(BS, max_position, HostToDevice(torch.device("cpu"), pin=False, nbytes=64), rows, seqs, blocks)


def slot(table, pos):
    return table[pos // BS] * BS + pos % BS


def test_spans_of_every_kind_pack_as_attention_reads_them():
    b = builder(max_position=40)
    prefill, decode, tree, padded = [3, 9, 4], [7, 2], [5, 6, 8, 1], [11, 12]
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)   # root, two children
    assert b.add(prefill, 2, 7, list(range(100, 107))) == 0                          # a chunk: positions 2..8
    assert b.add(decode, 5, 1, 55) == 7
    assert b.add_rows(tree, [13, 14, 14], [13, 14, 15], 16, [60, 61, 62], mask=tree_mask) == 8
    # Padding rows write no KV; a rotary position past max_position is clamped.
    assert b.add_rows(padded, [0, 41], [-1, 6], 7, [0, 70]) == 11
    built = b.finish(extras=([8, 9, 10], [6]))
    batch = built.batch
    assert built.input_ids.tolist() == list(range(100, 107)) + [55, 60, 61, 62, 0, 70]
    assert batch.positions.tolist() == list(range(2, 9)) + [5, 13, 14, 14, 0, 39]
    want_slots = ([slot(prefill, p) for p in range(2, 9)] + [slot(decode, 5)]
                  + [slot(tree, p) for p in (13, 14, 15)] + [-1, slot(padded, 6)])
    assert batch.slot_mapping.tolist() == want_slots
    assert batch.query_start_loc.tolist() == [0, 7, 8, 11, 13]
    assert batch.seq_lens.tolist() == [9, 6, 16, 7] == batch.seq_lens_cpu
    assert batch.query_lens_cpu == [7, 1, 3, 2] and batch.max_query_len == 7 and batch.max_seq_len == 16
    assert batch.block_tables.shape == (4, 4)
    for i, table in enumerate([prefill, decode, tree, padded]):
        assert batch.block_tables[i, :len(table)].tolist() == table
    assert batch.positions.dtype == batch.slot_mapping.dtype == torch.int64
    assert batch.query_start_loc.dtype == batch.seq_lens.dtype == batch.block_tables.dtype == torch.int32
    # The mask: causal for the spans without one, the tree's own for the tree span.
    want_mask = batch_tree_mask([7, 1, 3, 2], [None, None, tree_mask, None], 7)
    assert torch.equal(batch.tree_mask, want_mask)
    assert batch.uniform_query_len == 0 and not batch.is_decode
    assert [e.tolist() for e in built.extras] == [[8, 9, 10], [6]]


def test_uniform_rows_and_decode_batches():
    b = builder()
    for table in ([1], [2], [3]):
        b.add(table, 2, 1, 5)
    decode = b.finish().batch
    assert decode.is_decode and decode.uniform_query_len == 1 and decode.tree_mask is None
    for table in ([1, 2], [3, 4]):
        b.add(table, 2, 3)
    verify = b.finish(uniform_rows=True)
    assert verify.input_ids is None                      # no span brought ids: the caller fills them
    assert verify.batch.uniform_query_len == 3
    for table in ([1, 2], [3, 4]):
        b.add(table, 2, 3)
    assert b.finish().batch.uniform_query_len == 0       # plain prefill chunks stay on the prefill kernels
    b.add([1, 2], 0, 3)
    b.add([3], 0, 2)
    assert b.finish(uniform_rows=True).batch.uniform_query_len == 0   # different lengths


def test_batches_of_a_step_and_of_alternating_steps_stay_intact():
    """A step's batches take separate regions of its arena, arenas alternate per step, and a full arena is
    replaced without touching what was already handed out."""
    staging = HostToDevice(torch.device("cpu"), pin=False, nbytes=64)
    b = BatchBuilder(BS, 1000, staging, 1, 1, 1)
    kept = []
    for step in range(3):
        staging.new_step()
        for k in range(4):
            n = 1 + 5 * k                                 # growing batches: the arena grows mid-step
            b.add(list(range(10)), step, n, list(range(step * 100 + k, step * 100 + k + n)))
            kept.append((step, k, n, b.finish(extras=([step, k],))))
    for step, k, n, built in kept:
        assert built.input_ids.tolist() == list(range(step * 100 + k, step * 100 + k + n))
        assert built.batch.positions.tolist() == list(range(step, step + n))
        assert built.extras[0].tolist() == [step, k]
    assert staging.ints([2**62, -2**62]).tolist() == [2**62, -2**62]


def test_uniform_spans_at_once_pack_as_one_by_one():
    """add_uniform (a padded catch-up's spans in a few numpy ops) packs exactly what add_rows does span by span."""
    tables = [[3, 1, 8], [5], [7, 4, 11, 10]]
    ends = np.array([9, 3, 14])
    width = 4
    at = ends[:, None] - width + np.arange(width)
    live = at >= (ends - np.array([2, 3, 4]))[:, None]
    kv = np.where(live, at, -1)
    ids = np.arange(12).reshape(3, 4) + 100
    one_by_one, at_once = builder(), builder()
    for i, table in enumerate(tables):
        one_by_one.add_rows(table, np.maximum(at[i], 0), kv[i], int(ends[i]), ids[i].tolist())
    at_once.add([9], 0, 2, [1, 2])                            # after a span already in the batch
    one_by_one_first = builder()
    one_by_one_first.add([9], 0, 2, [1, 2])
    for i, table in enumerate(tables):
        one_by_one_first.add_rows(table, np.maximum(at[i], 0), kv[i], int(ends[i]), ids[i].tolist())
    assert at_once.add_uniform(tables, np.maximum(at, 0), kv, ends, ids) == 2
    want, got = one_by_one_first.finish(uniform_rows=True), at_once.finish(uniform_rows=True)
    for field in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert getattr(got.batch, field).tolist() == getattr(want.batch, field).tolist(), field
    assert got.input_ids.tolist() == want.input_ids.tolist()
    assert got.batch.query_lens_cpu == want.batch.query_lens_cpu and got.batch.seq_lens_cpu == want.batch.seq_lens_cpu
    assert got.batch.slot_mapping.tolist()[2:6] == [-1, -1, 1 * BS + 7 % BS, 8 * BS + 8 % BS]   # 2 padding rows
    one_by_one.finish()


def test_every_staged_and_graph_input_is_16_byte_aligned():
    """Triton compiles a variant per pointer alignment: a batch whose packing left its block tables at an
    8-byte offset compiled a decode-kernel variant inside a request on the H200. Odd row and sequence
    counts, one after another in one arena, and every section of a graph's inputs, start at 16 bytes."""
    b = builder()
    for seqs in range(1, 6):
        for i in range(seqs):
            b.add([1, 2, 3][:1 + i % 3], i % 2, 1 + (i + seqs) % 3, [7] * (1 + (i + seqs) % 3))
        built = b.finish(([1] * (seqs % 3),))
        batch = built.batch
        for t in (batch.positions, batch.slot_mapping, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                  built.input_ids, *built.extras):
            assert t.data_ptr() % 16 == 0, (seqs, t)
    graphs = StepGraphs("test", Recorder(3), 3, max_batch=5, max_blocks_per_seq=3, max_seq_len=64, device="cpu",
                        hidden_size=2, dtype=torch.float32, capture=False)
    for name in ("input_ids", "positions", "slot_mapping", "extra", "seq_lens", "live_rows", "block_tables"):
        assert getattr(graphs, name).data_ptr() % 16 == 0, name


def test_a_tree_span_attends_like_each_of_its_paths(tiny_model_dir):
    """Through the real model: a tree span (rotary position = depth, KV slots consecutive, mask) gives
    every node the hidden state of its root-to-node path run as an ordinary causal sequence."""
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=32, block_size=BS))
    runner = engine.runner
    prefix = [5, 17, 29, 3, 8, 11]
    parents = [-1, 0, 0, 1, 2]                            # root, two children, a grandchild under each
    tokens = [40, 41, 42, 43, 44]
    depth = [0, 1, 1, 2, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    b = runner.batch_builder(16, 4)
    table = [0, 1, 2, 3]
    runner.staging.new_step()
    n = len(prefix)
    with torch.inference_mode():
        b.add(table, 0, n, prefix)
        built = b.finish()
        runner.model(built.input_ids, built.batch, runner.kv_caches)             # the prefix's KV
        b.add_rows(table, [n + d for d in depth], list(range(n, n + 5)), n + 5, tokens, mask=mask)
        tree = b.finish(uniform_rows=True)
        got = runner.model(tree.input_ids, tree.batch, runner.kv_caches)
        for node in range(5):
            path, j = [], node
            while j >= 0:
                path.insert(0, tokens[j])
                j = parents[j]
            other = [10, 11, 12, 13]                          # fresh blocks: a plain causal sequence
            b.add(other, 0, n + len(path), prefix + path)
            plain = b.finish()
            want = runner.model(plain.input_ids, plain.batch, runner.kv_caches)[-1]
            torch.testing.assert_close(got[node], want, rtol=1e-5, atol=1e-5)


# ---- the one graph class ------------------------------------------------------------------------------

def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    big = batch_buckets(1024)
    assert big[:5] == [1, 2, 4, 8, 16] and big[-1] == 1024 and big == sorted(set(big))


class Recorder:
    """A step function that remembers what it was run on and returns per-row and per-sequence outputs."""

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def __call__(self, ids, hidden, batch):
        self.calls.append(dict(ids=ids.clone(), hidden=None if hidden is None else hidden.clone(),
                               positions=batch.positions.clone(), slots=batch.slot_mapping.clone(),
                               seq_lens=batch.seq_lens.clone(), tables=batch.block_tables.clone(),
                               mask=None if batch.tree_mask is None else batch.tree_mask.clone(),
                               uniform=batch.uniform_query_len, num_seqs=batch.num_seqs,
                               live_rows=batch.live_rows.tolist()))
        per_row = ids * 10 + batch.positions
        last = per_row[self.rows - 1::self.rows]                  # one row per sequence, like the catch-up
        return per_row, last


@pytest.mark.parametrize("rows", [1, 3])
def test_padding_up_to_the_bucket_and_cutting_back(rows):
    fn = Recorder(rows)
    mask = torch.ones(rows, rows, dtype=torch.bool).tril()
    graphs = StepGraphs("test", fn, rows, max_batch=5, max_blocks_per_seq=4, max_seq_len=64, device="cpu",
                        hidden_size=2, dtype=torch.float32, tree_mask=mask if rows > 1 else None, capture=False)
    assert graphs.buckets == [1, 2, 4, 5] and not graphs.graphs          # nothing captured on the CPU
    b = builder()
    tables = [[1, 2], [3, 7], [4, 5, 6]]
    for i, table in enumerate(tables):
        if rows > 1:
            b.add_rows(table, [4 + d for d in range(rows)], list(range(4, 4 + rows)), 4 + rows,
                       mask=torch.eye(rows, dtype=torch.bool) | (torch.arange(rows)[:, None] == 0) if i == 1 else mask)
        else:
            b.add(table, 4, 1)
    batch = b.finish(uniform_rows=True).batch
    assert graphs.fits(batch)
    ids = torch.arange(3 * rows) + 1
    hidden = torch.randn(3 * rows, 2)
    per_row, last = graphs.run(ids, hidden, batch)
    call = fn.calls[-1]
    assert call["num_seqs"] == 4 and call["uniform"] == rows                  # 3 sequences padded to bucket 4
    assert call["ids"][:3 * rows].tolist() == ids.tolist() and torch.equal(call["hidden"][:3 * rows], hidden)
    assert call["slots"][:3 * rows].tolist() == batch.slot_mapping.tolist()
    assert call["slots"][3 * rows:].tolist() == [-1] * rows                  # padding writes no KV
    assert call["seq_lens"].tolist() == batch.seq_lens.tolist() + [rows]     # and reads a few slots
    assert call["live_rows"] == [3 * rows]                                    # the MoE router's count
    assert call["tables"][:3, :3].tolist() == batch.block_tables.tolist()
    if rows > 1:
        assert torch.equal(call["mask"][:3 * rows], batch.tree_mask)          # the mask is an input
    # Outputs cut to the live sequences, per-row and per-sequence outputs alike.
    assert per_row.tolist() == (ids * 10 + batch.positions).tolist()
    assert last.tolist() == per_row[rows - 1::rows].tolist()
    assert graphs.replays == 1
    # Other shapes are not this graph's: a different row count, or more sequences than the largest bucket.
    b.add([1], 0, rows + 1)
    assert not graphs.fits(b.finish(uniform_rows=True).batch)
    for _ in range(6):
        b.add([1], 0, 1) if rows == 1 else b.add_rows([1, 2], list(range(rows)), list(range(rows)), rows)
    assert not graphs.fits(b.finish(uniform_rows=True).batch)


def test_load_from_host_spans_gives_the_graph_what_run_gives_it():
    """A batch loaded straight from the builder's host arrays (one copy, padding included) reaches the
    graph's function exactly as the same batch sent through run(); three loads in a row reuse the two
    host mirrors in turn, each still correct."""
    rows = 3
    fn = Recorder(rows)
    graphs = StepGraphs("test", fn, rows, max_batch=5, max_blocks_per_seq=4, max_seq_len=64, device="cpu",
                        hidden_size=2, dtype=torch.float32, capture=False)
    b = builder()
    for trial, tables in enumerate(([[1, 2], [3, 7], [4, 5, 6]], [[9]], [[2, 3], [8, 1, 0, 5]])):
        def spans():
            for i, table in enumerate(tables):
                start = 3 + i + trial
                b.add_rows(table, np.maximum(np.arange(start - 4, start - 1), 0), [-1, start - 2, start - 1], start,
                           [10 * trial + i] * rows)
        spans()
        built = b.finish(uniform_rows=True)
        graphs.run(built.input_ids, torch.zeros(len(tables) * rows, 2), built.batch)
        want = fn.calls[-1]
        spans()
        extra = np.arange(len(tables) * rows)[::-1].copy()
        n = graphs.load(b.finish_host(), extra)
        assert n == len(tables)
        per_row, _ = graphs.replay(n)
        got = fn.calls[-1]
        bucket = graphs.bucket_for(n)
        for key in ("ids", "positions", "slots", "seq_lens"):
            assert got[key][:bucket * rows if key != "seq_lens" else bucket].tolist() == \
                want[key][:bucket * rows if key != "seq_lens" else bucket].tolist(), key
        for i, table in enumerate(tables):      # past a sequence's own blocks nothing is read
            assert got["tables"][i, :len(table)].tolist() == want["tables"][i, :len(table)].tolist() == table
        assert got["num_seqs"] == want["num_seqs"] == bucket
        assert got["live_rows"] == want["live_rows"] == [len(tables) * rows]
        assert graphs.extra[:len(extra)].tolist() == extra.tolist()
        assert per_row.shape[0] == n * rows
    assert graphs.replays == 6


def test_decode_graph_path_equals_eager_on_cpu(tiny_model_dir, monkeypatch):
    """The runner's decode graph (capture off) pads a batch of 3 to bucket 4 and gives eager's hidden
    states, and padding leaves every live KV slot as eager wrote it."""
    from llmserve_core.engine import model_runner
    cfg = dict(model=tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=16, block_size=BS, max_num_seqs=5)
    monkeypatch.setattr(model_runner, "use_cuda_graphs", lambda *args: True)
    engine = Engine(EngineConfig(**cfg))
    runner = engine.runner
    assert runner.graphs is not None and not runner.graphs.capture
    tables = [[0, 1], [2], [3, 4]]
    starts = [5, 2, 6]
    b = runner.batch_builder(8, 4)
    with torch.inference_mode():
        for table, start in zip(tables, starts):
            b.add(table, 0, start + 1, list(range(3, 4 + start)))
        built = b.finish()
        runner.model(built.input_ids, built.batch, runner.kv_caches)      # context KV, then one decode row each
        for table, start in zip(tables, starts):
            b.add(table, start, 1, 9)
        step = b.finish()
        before = [k.clone() for k, _ in runner.kv_caches]
        eager = runner.model(step.input_ids, step.batch, runner.kv_caches)
        eager_kv = [k.clone() for k, _ in runner.kv_caches]
        for (k, _), saved in zip(runner.kv_caches, before):
            k.copy_(saved)
        graphed = runner.graphs.run(step.input_ids, None, step.batch)[0]
    assert runner.graphs.replays == 1
    # Float32 GEMMs over 4 rows round differently from 3: close, not bit-equal.
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    for (k, _), want in zip(runner.kv_caches, eager_kv):
        torch.testing.assert_close(k, want, rtol=1e-5, atol=1e-5)


# ---- on the GPU: replay == eager for every rows-per-sequence kind -------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["decode", "verify-chain", "verify-tree", "catch-up"])
def test_captured_replay_equals_eager(tiny_model_dir, kind):
    """A captured graph of each shape the engine replays (1 row, R causal rows, R tree rows with the mask
    as an input, R rows with a hidden input and one output row per sequence) gives eager's outputs and KV
    for a batch padded up to its bucket."""
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cuda", dtype="float32", attention_backend="triton",
                                 num_kv_blocks=64, block_size=BS, max_num_seqs=6, enforce_eager=True))
    runner, model = engine.runner, engine.runner.model
    rows = 1 if kind == "decode" else 4
    hidden_size = engine.model_config.hidden_size if kind == "catch-up" else None

    def fn(ids, hidden, batch):
        if hidden is None:
            out = model(ids, batch, runner.kv_caches)
        else:       # a stand-in for the draft: the target's layers over embeddings plus a hidden input
            out = model(ids, batch, runner.kv_caches) + hidden
        logits = model.compute_logits(out)
        return (logits[rows - 1::rows],) if kind == "catch-up" else (logits, out)
    mask0 = torch.ones(rows, rows, dtype=torch.bool).tril()
    graphs = StepGraphs(kind, fn, rows, max_batch=6, max_blocks_per_seq=runner.max_blocks_per_seq, max_seq_len=64,
                        device=runner.device, hidden_size=hidden_size, dtype=runner.dtype,
                        tree_mask=mask0 if kind == "verify-tree" else None, capture=True)
    gen = torch.Generator().manual_seed(0)
    tables = [[4 * i, 4 * i + 1, 4 * i + 2] for i in range(3)]           # 3 sequences: padded to bucket 4
    starts = [5, 3, 7]
    b = runner.batch_builder(64, 8)
    with torch.inference_mode():
        for table, start in zip(tables, starts):
            b.add(table, 0, start, torch.randint(0, 200, (start,), generator=gen).tolist())
        ctx = b.finish()
        model(ctx.input_ids, ctx.batch, runner.kv_caches)
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device="cuda")
        for table, start in zip(tables, starts):
            if kind == "verify-tree":
                b.add_rows(table, [start, start + 1, start + 1, start + 2], list(range(start, start + 4)), start + 4,
                           mask=tree)
            else:
                b.add(table, start, rows)
        step = b.finish(uniform_rows=True)
        ids = torch.randint(0, 200, (3 * rows,), generator=gen).cuda()
        hidden = torch.randn(3 * rows, hidden_size, generator=gen).cuda() if hidden_size else None
        before = [k.clone() for k, _ in runner.kv_caches]
        eager = fn(ids, hidden, step.batch)
        eager_kv = [k.clone() for k, _ in runner.kv_caches]
        for (k, _), saved in zip(runner.kv_caches, before):
            k.copy_(saved)
        assert graphs.fits(step.batch)
        replayed = graphs.run(ids, hidden, step.batch)
        torch.cuda.synchronize()
    for got, want in zip(replayed, eager):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (k, _), want in zip(runner.kv_caches, eager_kv):
        torch.testing.assert_close(k, want, rtol=1e-5, atol=1e-5)


def test_run_pads_with_valid_ids_after_loads_left_placeholders():
    """A decode load carries its placeholder rows' ids as -1 (filled on the device). A later run() over a
    bigger bucket than the last load's must not hand those stale -1s to its padding rows: an embedding of
    -1 is a device-side assert (issue 62's class of fault)."""
    fn = Recorder(1)
    graphs = StepGraphs("test", fn, 1, max_batch=8, max_blocks_per_seq=2, max_seq_len=64, device="cpu",
                        capture=False)
    b = builder()
    for n in (8, 8, 2):             # 8 placeholder rows in both host mirrors, then a smaller load
        for i in range(n):
            b.add([i], 1, 1, -1)
        graphs.load(b.finish_host())
    for i in range(5):
        b.add([i], 1, 1, 7)
    built = b.finish(uniform_rows=True)
    graphs.run(built.input_ids, None, built.batch)
    assert fn.calls[-1]["ids"].tolist() == [7] * 5 + [0] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory, async copies)")
@pytest.mark.gpu
def test_an_arena_is_refilled_only_after_its_copies_ran():
    """Steps that sample nothing (a long prompt's chunks) are not waited for by the engine: the arena two
    steps back must still be copied before the host writes it again, however far behind the GPU is."""
    staging = HostToDevice(torch.device("cuda"), pin=True, nbytes=1 << 12)
    got = []
    for step in range(6):
        staging.new_step()
        torch.cuda._sleep(20_000_000)          # the GPU falls well behind the host
        got.append(staging.ints(np.full(256, step)))
    torch.cuda.synchronize()
    assert [t.unique().tolist() for t in got] == [[s] for s in range(6)]
