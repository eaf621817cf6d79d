"""The proposer seam (engine/spec/proposer.py): a way of making drafts other than EAGLE-3, with no model,
no KV and no per-request state, shares the verify path, lossless sampling and the step's bookkeeping as
they are. A proposer that knows each request's greedy continuation (every draft right) and one that
proposes it shifted by one token id (every draft wrong) both give exactly the plain engine's tokens,
greedy and seeded, through chunked prefill and preemption."""
from __future__ import annotations

import pytest
import torch

from helpers.models import make_prompts
from llmserve_core import Engine, EngineConfig
from llmserve_core.engine import runtime
from llmserve_core.engine.spec.proposer import Proposal, Proposer
from llmserve_core.models.tiny_draft import make_tiny_draft
from llmserve_proto import SamplingParams

MAX_NEW = 10
DEPTH = 3
SCHEDULES = {"plain": {}, "chunked-preempting": dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=9)}


class KnownContinuation(Proposer):
    """Drafts each request's continuation from `known` (prompt -> the tokens after it), shifted by `shift`."""

    def __init__(self, known: dict[tuple[int, ...], list[int]], shift: int):
        super().__init__()
        self.known, self.shift = known, shift

    def propose(self, sched, drafting, depth):
        vocab = self.ctx.runner.model_config.vocab_size
        rows = []
        for req in drafting:
            done = req.num_tokens - req.num_prompt_tokens
            rows.append([(t + self.shift) % vocab for t in self.known[tuple(req.prompt_token_ids)][done:done + depth]])
        tokens = torch.tensor(rows, dtype=torch.long, device=self.ctx.device).reshape(len(drafting), depth)
        return Proposal(tokens)


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    """(prompts, greedy continuations past MAX_NEW + DEPTH, a draft directory for the config to name)."""
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32"))
    prompts = make_prompts(engine.model_info.vocab_size, seed=4)
    greedy = SamplingParams(max_tokens=MAX_NEW + DEPTH + 1, temperature=0.0, ignore_eos=True)
    known = {tuple(p): c.token_ids for p, c in zip(prompts, engine.generate(prompts, greedy))}
    return prompts, known, make_tiny_draft(tmp_path_factory.mktemp("draft"), tiny_model_dir, seed=1)


def params(n: int) -> list[SamplingParams]:
    """Greedy requests, and every third one sampled with a seed (its noise keyed by position)."""
    return [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_k=20, seed=i, ignore_eos=True) if i % 3 == 2
            else SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True) for i in range(n)]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("shift", [0, 1], ids=["right", "wrong"])
def test_another_proposer_shares_the_verify_path(tiny_model_dir, setup, monkeypatch, schedule, shift):
    prompts, known, draft_dir = setup
    cfg = dict(model=tiny_model_dir, device="cpu", dtype="float32", **SCHEDULES[schedule])
    want = [c.token_ids for c in Engine(EngineConfig(**cfg)).generate(prompts, params(len(prompts)))]
    proposer = KnownContinuation(known, shift)
    monkeypatch.setattr(runtime, "load_proposer", lambda config, runner, max_positions: proposer)
    engine = Engine(EngineConfig(**cfg, speculative_model=draft_dir, speculative_num_steps=DEPTH,
                                 speculative_policy="always"))
    assert engine.spec.proposer is proposer and not engine.block_manager.recompute_last_hit_block
    got = [c.token_ids for c in engine.generate(prompts, params(len(prompts)))]
    assert got == want
    st = engine.stats()
    assert st["spec_num_steps"] > 0 and st["spec_num_draft_tokens"] > 0
    # Greedy requests alone: every draft is accepted, or none is.
    engine.reset_counters()
    greedy_only = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in greedy_only] == [known[tuple(p)][:MAX_NEW] for p in prompts]
    st = engine.stats()
    assert st["spec_num_draft_tokens"] > 0 and st["spec_acceptance_rate"] == (0.0 if shift else 1.0)
    if schedule != "plain":
        assert st["num_preemptions"] > 0
