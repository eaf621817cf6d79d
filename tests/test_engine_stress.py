"""Randomized add / abort / step sequences against the in-process Engine over a tiny KV pool (block size 2,
a few blocks over one request's need): preemption, prefix-cache hits between identical and overlapping
prompts, chunked prefill, async scheduling and EAGLE-3 drafting all interleave. After every step the
block manager's invariants hold and each block's reference count is what the live requests hold; at the
end every block is unreferenced and each request that was not aborted produced exactly what it produces
alone (greedy, stop tokens, seeded sampling, logprobs, logits processing), with the same finish reason,
reported once, so no interleaving may change or lose a token or a block. With faults injected into
steps, the requests fail_step() drops end there and every other request still produces its solo run."""
from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from llmserve_core import Engine, EngineConfig
from llmserve_core.engine.request import RequestStatus
from llmserve_core.models.tiny_draft import make_tiny_draft
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
    kind = rnd.randrange(5)
    if kind == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=rnd.randrange(100))
    if kind == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[stop])
    if kind == 2:      # decodes plainly in a speculative core
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=rnd.randrange(3))
    if kind == 3:      # logits processing: penalty rows make an async step read the one in flight back first
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=rnd.randrange(100), presence_penalty=0.5,
                              min_tokens=rnd.randrange(max_tokens + 1), stop_token_ids=[stop], logit_bias={stop: 2.0})
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=rnd.random() < 0.5)


class Faults:
    """Makes the launches (runner, executor) and the readback of steps raise now and then, before or after
    their work."""

    def __init__(self, engine: Engine, rnd: random.Random, rate: float):
        self.rnd, self.rate = rnd, rate
        for owner, name in ((engine.runner, "launch_forward"), (engine.runner, "launch_sample"), (engine.spec, "execute"),
                            (engine, "_complete")):
            if owner is not None:
                setattr(owner, name, self.wrap(getattr(owner, name)))

    def wrap(self, fn):
        def faulty(*args, **kwargs):
            self.maybe_raise()
            out = fn(*args, **kwargs)
            self.maybe_raise()
            return out
        return faulty

    def maybe_raise(self) -> None:
        if self.rnd.random() < self.rate:
            raise RuntimeError("injected fault")


def run_random_workload(models, schedule: str, seed: int, fault_rate: float = 0.0) -> None:
    target, draft, reference = models
    config = dict(SCHEDULES[schedule])
    speculative = "speculative_gamma" in config
    engine = Engine(EngineConfig(model=target, device="cpu", dtype="float32", block_size=2, max_model_len=MAX_LEN,
                                 speculative_model=draft if speculative else None, **config))
    rnd = random.Random(seed)
    faults = Faults(engine, random.Random(seed + 1), fault_rate) if fault_rate else None
    vocab = engine.model_info.vocab_size
    shared = [rnd.randrange(vocab) for _ in range(9)]
    expected, got, logprobs, finished, asked, prompt = {}, {}, {}, {}, {}, None
    eos = set(engine.model_info.eos_token_ids)

    def step():
        try:
            outputs = engine.step()
        except RuntimeError:
            if faults is None:
                raise
            for rid in engine.fail_step():
                assert rid not in finished
                finished[rid] = "error"
            outputs = []
        for out in outputs:
            rid = out.request_id
            assert rid not in finished, f"{rid} reported after it ended ({finished[rid]})"
            got[rid] += out.new_token_ids
            logprobs[rid] += out.logprobs or []
            if out.finish_reason is not None:
                finished[rid] = out.finish_reason
        check_blocks(engine)

    for i in range(30):
        op = rnd.random()
        if op < 0.3:
            if prompt is None or rnd.random() < 0.7:     # else the same prompt again (n > 1 copies, retries)
                prompt = shared[:rnd.randrange(10)] + [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 9))]
            # Often up to max_model_len exactly.
            max_tokens = min(rnd.randrange(1, 8), MAX_LEN - len(prompt)) if rnd.random() < 0.6 else MAX_LEN - len(prompt)
            # A stop token the greedy continuation produces, so stops happen.
            free = reference.generate([prompt], SamplingParams(max_tokens=MAX_LEN - len(prompt), temperature=0.0,
                                                               ignore_eos=True))[0].token_ids
            # Seeded sampling too: its tokens depend on seed and position alone, drafted or not.
            params = random_params(rnd, max_tokens, rnd.choice(free))
            rid = f"r{i}"
            engine.add_request(rid, prompt, params)
            expected[rid] = reference.generate([prompt], params)[0]
            asked[rid] = (len(prompt), params)
            got[rid], logprobs[rid] = [], []
        elif op < 0.4 and got:
            rid = rnd.choice(sorted(got))
            if rid in engine.requests:       # else it ended already (an abort is then ignored)
                expected[rid] = None
            engine.abort(rid)
        else:
            step()
    for _ in range(300):
        if not engine.has_unfinished():
            break
        step()
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    assert finished.keys() == got.keys()
    for rid, want in expected.items():
        if want is None:
            assert finished[rid] == "abort"
        elif finished[rid] != "error":
            assert (got[rid], finished[rid]) == (want.token_ids, want.finish_reason), rid
            num_prompt, params = asked[rid]
            length = len(got[rid]) == params.max_tokens or num_prompt + len(got[rid]) == MAX_LEN
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
            stop = got[rid][-1] in stops
            assert finished[rid] == ("stop" if stop else "length") and (stop or length), rid
            assert not stops & set(got[rid][:-1]), rid
            assert len(got[rid]) >= params.min_tokens or not stop, rid
            want_logprobs = want.logprobs or []
            assert len(logprobs[rid]) == (len(got[rid]) if want.logprobs is not None else 0), rid
            assert [[t for t, _ in lp.top] for lp in logprobs[rid]] == [[t for t, _ in lp.top] for lp in want_logprobs]
            assert [[lp.logprob] + [v for _, v in lp.top] for lp in logprobs[rid]] == [
                pytest.approx([lp.logprob] + [v for _, v in lp.top], abs=1e-4) for lp in want_logprobs], rid
    if faults is not None:
        assert "error" in finished.values()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31))
def test_random_add_abort_step_keeps_outputs_and_blocks(models, schedule, seed):
    run_random_workload(models, schedule, seed)


@pytest.mark.parametrize("schedule", ["async-chunked", "chain-adaptive"])
@settings(max_examples=2, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31))
def test_failed_steps_end_only_their_requests(models, schedule, seed):
    run_random_workload(models, schedule, seed, fault_rate=0.05)
