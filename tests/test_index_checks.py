"""LLMSERVE_CHECK_INDICES: a corrupted block table, slot, length, placeholder fill, sampled token or graph input is
caught on the host before the forward, by an error naming the request and the field; the engine drops that
step's requests and serves on. With the checks on, correct runs (chunked, preempting, graphs, EAGLE-3) pass."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from llmserve_core import Engine, EngineConfig
from llmserve_core.engine.batch_builder import BatchBuilder
from llmserve_core.layers import index_checks
from llmserve_core.layers.index_checks import IndexCheckError, IndexLimits, check_spans
from llmserve_core.models.tiny_draft import make_tiny_draft
from llmserve_proto import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def checks_on(monkeypatch):
    monkeypatch.setattr(index_checks, "ENABLED", True)


def prompts(vocab: int, lens=(3, 9, 21)) -> list[list[int]]:
    r = random.Random(5)
    return [[r.randrange(vocab) for _ in range(n)] for n in lens]


def engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=path, device="cpu", dtype="float32", **kw))


@pytest.mark.parametrize("kw", [dict(async_scheduling=True, num_kv_blocks=12, block_size=4, max_num_batched_tokens=7),
                                dict(async_scheduling=True, step_graphs=True)], ids=["chunked-preempting", "graphs"])
def test_correct_runs_pass_the_checks(tiny_model_dir, checks_on, monkeypatch, kw):
    if kw.pop("step_graphs", False):
        monkeypatch.setenv("LLMSERVE_CPU_STEP_GRAPHS", "1")
    plain = engine(tiny_model_dir).generate(prompts(1024), GREEDY)
    e = engine(tiny_model_dir, **kw)
    assert [c.token_ids for c in e.generate(prompts(1024), GREEDY)] == [c.token_ids for c in plain]


def test_eagle_runs_pass_the_checks(tiny_model_dir, tmp_path, checks_on, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_STEP_GRAPHS", "1")       # the executor's graphs' bookkeeping too
    draft = make_tiny_draft(tmp_path / "draft", tiny_model_dir, seed=1)
    e = engine(tiny_model_dir, speculative_model=draft, speculative_policy="always", speculative_tree="eagle-small")
    assert all(len(c.token_ids) == 6 for c in e.generate(prompts(1024), GREEDY))
    assert e.stats()["spec_num_steps"] > 0


def _running_engine(path, **kw) -> tuple[Engine, list[str]]:
    """An engine with three requests past their first step (their blocks allocated)."""
    e = engine(path, **kw)
    ids = []
    for i, p in enumerate(prompts(1024)):
        e.add_request(f"req-{i}", p, GREEDY)
        ids.append(f"req-{i}")
    e.step()
    return e, ids


def test_corrupt_block_table_is_named(tiny_model_dir, checks_on):
    e, ids = _running_engine(tiny_model_dir, block_size=4)
    blocks = e.requests["req-1"].block_ids
    good, blocks[0] = blocks[0], e.block_manager.num_blocks + 3
    with pytest.raises(IndexCheckError, match=r"request 'req-1' .*block_tables\[1\]\[0\] = \d+ is outside"):
        e.step()
    blocks[0] = good                                # (the block manager frees what it handed out)
    assert set(e.fail_step()) == set(ids)           # the step's requests fail; the engine serves on
    assert [len(c.token_ids) for c in e.generate(prompts(1024)[:1], GREEDY)] == [6]


def test_corrupt_slot_mapping_is_named(tiny_model_dir, checks_on, monkeypatch):
    e, _ = _running_engine(tiny_model_dir, block_size=4)
    other = e.requests["req-0"].block_ids[0]
    add = BatchBuilder.add

    def add_bad_slot(self, block_ids, start, n, token_ids=None, seq_len=None):
        row = add(self, block_ids, start, n, token_ids, seq_len)
        if block_ids is e.requests["req-2"].block_ids:
            self.slots[row] = other * self.block_size        # another request's block
        return row
    monkeypatch.setattr(BatchBuilder, "add", add_bad_slot)
    with pytest.raises(IndexCheckError, match=r"request 'req-2' .*slot_mapping\[2\] = \d+ is in block \d+, not one"):
        e.step()


def test_corrupt_seq_len_and_position_are_named():
    limits = IndexLimits(num_blocks=8, block_size=4, max_positions=32, vocab_size=100)
    args = dict(positions=np.array([0, 1, 2, 5]), slots=np.array([0, 1, 2, 17]), query_lens=[3, 1],
                seq_lens=np.array([3, 6]), tables=np.array([[0, 0], [3, 4]], dtype=np.int32),
                ids=np.array([1, 2, 3, 4]), names=["a", "b"])
    check_spans("test", limits, **args)               # consistent: passes
    with pytest.raises(IndexCheckError, match=r"request b .*seq_lens\[1\] = 9 needs 3 blocks"):
        check_spans("test", limits, **{**args, "seq_lens": np.array([3, 9])})
    with pytest.raises(IndexCheckError, match=r"request a .*positions\[1\] = 40 is outside the rotary"):
        check_spans("test", limits, **{**args, "positions": np.array([0, 40, 2, 5])})
    with pytest.raises(IndexCheckError, match=r"request b .*slot_mapping\[3\] = 19 is position 7, past seq_len 6"):
        check_spans("test", limits, **{**args, "slots": np.array([0, 1, 2, 19])})
    with pytest.raises(IndexCheckError, match=r"request a .*input_ids\[2\] = 100 is outside the vocabulary"):
        check_spans("test", limits, **{**args, "ids": np.array([1, 2, 100, 4])})
    with pytest.raises(IndexCheckError, match=r"request a .*input_ids\[0\] = -1"):
        check_spans("test", limits, **{**args, "ids": np.array([-1, 2, 3, 4])}, placeholders=False)
    with pytest.raises(IndexCheckError, match=r"sequence 1 of 2\): block_tables\[1\]\[1\] = -5"):
        check_spans("test", limits, **{**args, "tables": np.array([[0, 0], [3, -5]], dtype=np.int32), "names": None})


def test_bad_placeholder_fill_is_named(tiny_model_dir, checks_on):
    e, _ = _running_engine(tiny_model_dir, async_scheduling=True)
    e.requests["req-2"].sample_index = 7                  # the step before sampled 3 tokens
    with pytest.raises(IndexCheckError, match=r"request 'req-2': sample_index 7 is outside the 3 tokens"):
        e.step()


def test_bad_sampled_token_is_named(tiny_model_dir, checks_on, monkeypatch):
    e, _ = _running_engine(tiny_model_dir)
    sample = e.runner.sample

    def bad(hidden, reqs):
        out = sample(hidden, reqs)
        out.token_ids = torch.full_like(out.token_ids, 5000)
        return out
    monkeypatch.setattr(e.runner, "sample", bad)
    with pytest.raises(IndexCheckError, match=r"sampled tokens: request 'req-0': token id 5000 is outside"):
        e.step()


def test_graph_padding_input_is_checked(tiny_model_dir, checks_on, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_STEP_GRAPHS", "1")
    e, _ = _running_engine(tiny_model_dir)
    graphs = e.runner.graphs
    replay = graphs.replay

    def corrupt_then_replay(n):
        graphs.block_tables[graphs.bucket_for(n) - 1, 0] = 10 ** 6    # the last padding sequence's table
        return replay(n)
    monkeypatch.setattr(graphs, "replay", corrupt_then_replay)
    with pytest.raises(IndexCheckError, match=r"decode graph's inputs \(3 sequences, padded to 4\): request graph "
                                              r"padding 0 .*block_tables\[3\]\[0\] = 1000000"):
        e.step()


def test_model_forward_checks_device_ids(tiny_model_dir, checks_on):
    """Ids filled on the device (placeholders, drafts) meet the model forward's own check."""
    e, _ = _running_engine(tiny_model_dir)
    batch = e.runner.builder
    batch.add(e.requests["req-0"].block_ids, 0, 2, [1, 2])
    built = batch.finish()
    built.input_ids[1] = 4096
    with pytest.raises(IndexCheckError, match=r"the model's forward: a sequence \(sequence 0 of 1\): input_ids\[1\] = 4096"):
        e.runner.model(built.input_ids, built.batch, e.runner.kv_caches)


def test_off_costs_no_check(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(index_checks, "ENABLED", False)

    def never(*a, **k):
        raise AssertionError("checked with the checks off")
    monkeypatch.setattr(index_checks, "check_spans", never)
    monkeypatch.setattr(index_checks, "check_batch", never)
    assert all(len(c.token_ids) == 6 for c in engine(tiny_model_dir).generate(prompts(1024), GREEDY))
