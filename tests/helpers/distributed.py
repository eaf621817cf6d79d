"""Tensor parallelism on the CPU for tests: an engine of N gloo ranks run over prompts that hit chunked
prefill, preemption and the prefix cache, and the graph path's bookkeeping on every rank."""
from __future__ import annotations

import pytest

from llmserve_core import EngineConfig, start_engine
from llmserve_proto import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SHARED = list(range(40, 75))
PROMPTS = [SHARED + [5, 6], [7, 8, 9], SHARED + [11], list(range(100, 123))]


def run(model, tp, **kwargs):
    def generate(engine):
        outs = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        again = engine.generate([PROMPTS[0]], GREEDY)[0]          # the second pass hits the prefix cache
        return outs + [again.token_ids], engine.stats()
    return run_with(model, tp, generate, **kwargs)


def run_with(model, tp, body, **kwargs):
    """body(engine) on a fresh engine of `tp` ranks."""
    # 24 blocks of 4 tokens and a 9-token budget: chunked prefill, preemption and prefix hits in one run.
    cfg = dict(model=model, device="cpu", dtype="float32", tensor_parallel_size=tp, block_size=4, num_kv_blocks=24,
               max_num_batched_tokens=9, max_num_seqs=4, distributed_timeout=120.0)
    engine = start_engine(EngineConfig(**{**cfg, **kwargs}))
    try:
        return body(engine)
    finally:
        engine.close()


@pytest.fixture
def graph_path(monkeypatch):
    """The step graphs' bookkeeping on (capture off: the CPU's stand-in for CUDA graphs), on rank 0 and,
    through the environment, on the spawned workers; returns the (graph, live sequences, bucket) of each
    replay rank 0 makes (the workers are fresh processes: the spy is rank 0's alone)."""
    from llmserve_core.engine.step_graphs import StepGraphs
    monkeypatch.setenv("LLMSERVE_CPU_STEP_GRAPHS", "1")
    replays = []
    real = StepGraphs.replay

    def replay(self, n):
        replays.append((self.name, n, self.bucket_for(n)))
        return real(self, n)
    monkeypatch.setattr(StepGraphs, "replay", replay)
    return replays
