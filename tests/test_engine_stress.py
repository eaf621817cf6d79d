"""Randomized add / abort / step sequences against the in-process Engine over a tiny KV pool (block size 2,
a few blocks over one request's need): preemption, prefix-cache hits between identical and overlapping
prompts, chunked prefill, async scheduling and EAGLE-3 drafting all interleave. After every step the
block manager's invariants hold and each block's reference count is what the live requests hold; at the
end every block is unreferenced and each request that was not aborted produced exactly what it produces
alone (greedy, stop tokens, seeded sampling), so no interleaving may change or lose a token or a block."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from llmserve_core import Engine, EngineConfig
from llmserve_core.engine.request import RequestStatus
from llmserve_core.models.eagle3 import make_tiny_draft
from llmserve_proto import SamplingParams

MAX_LEN = 20
SCHEDULES = {
    "async-chunked": dict(num_kv_blocks=11, max_num_batched_tokens=5, max_num_seqs=3, async_scheduling=True),
    "no-chunking": dict(num_kv_blocks=11, max_num_batched_tokens=MAX_LEN, max_num_seqs=4, enable_chunked_prefill=False),
    "chain-adaptive": dict(num_kv_blocks=13, max_num_batched_tokens=6, max_num_seqs=3, speculative_gamma=2,
                           speculative_policy="adaptive"),
    "tree-always": dict(num_kv_blocks=14, max_num_batched_tokens=8, max_num_seqs=3, speculative_gamma=2,
                        speculative_tree="binary", speculative_policy="always"),
}


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    draft = make_tiny_draft(tmp_path_factory.mktemp("draft"), tiny_model_dir, seed=1)
    reference = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    return str(tiny_model_dir), draft, reference


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: two intra-op threads on a busy 2-core machine run several times slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def check_blocks(engine: Engine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    held = Counter()
    for req in engine.requests.values():
        assert len(set(req.block_ids)) == len(req.block_ids)
        if req.status == RequestStatus.WAITING:
            assert not req.block_ids, f"{req.request_id} waits holding blocks"
        held.update(req.block_ids)
    assert [held[b] for b in range(bm.num_blocks)] == bm.ref_counts


def random_params(rnd: random.Random, max_tokens: int, stop: int) -> SamplingParams:
    kind = rnd.randrange(3)
    if kind == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=rnd.randrange(100))
    if kind == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[stop])
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=rnd.random() < 0.5)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31))
def test_random_add_abort_step_keeps_outputs_and_blocks(models, one_thread, schedule, seed):
    target, draft, reference = models
    config = dict(SCHEDULES[schedule])
    speculative = "speculative_gamma" in config
    engine = Engine(EngineConfig(model=target, device="cpu", dtype="float32", block_size=2, max_model_len=MAX_LEN,
                                 speculative_model=draft if speculative else None, **config))
    rnd = random.Random(seed)
    vocab = engine.model_info.vocab_size
    shared = [rnd.randrange(vocab) for _ in range(9)]
    expected, got, prompt = {}, {}, None
    for i in range(30):
        op = rnd.random()
        if op < 0.3:
            if prompt is None or rnd.random() < 0.7:     # else the same prompt again (n > 1 copies, retries)
                prompt = shared[:rnd.randrange(10)] + [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 9))]
            # Often up to max_model_len exactly.
            max_tokens = min(rnd.randrange(1, 8), MAX_LEN - len(prompt)) if rnd.random() < 0.6 else MAX_LEN - len(prompt)
            # Seeded sampling too: its tokens depend on seed and position alone, drafted or not.
            params = random_params(rnd, max_tokens, rnd.randrange(vocab))
            rid = f"r{i}"
            engine.add_request(rid, prompt, params)
            expected[rid] = reference.generate([prompt], params)[0].token_ids
            got[rid] = []
        elif op < 0.4 and got:
            rid = rnd.choice(sorted(got))
            engine.abort(rid)
            del got[rid], expected[rid]
        else:
            for out in engine.step():
                if out.request_id in got:
                    got[out.request_id] += out.new_token_ids
            check_blocks(engine)
    for _ in range(300):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id in got:
                got[out.request_id] += out.new_token_ids
        check_blocks(engine)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    assert got == expected
