"""A Qwen3-MoE model served by the in-process Engine, float32 on CPU: greedy outputs token-exact against
transformers' Qwen3MoeForCausalLM whatever the scheduling (chunked prefill, prefix hits, preemption, async
scheduling, the decode graphs' bookkeeping), and with an EAGLE-3 draft drafting over it."""
from __future__ import annotations

import pytest
import torch

from helpers.engine import SCHEDULES, assert_all_blocks_free, hf_greedy
from helpers.models import make_prompts
from llmserve_core import Engine, EngineConfig
from llmserve_core.kernels.moe_reference import route_reference
from llmserve_core.models.tiny_draft import make_tiny_draft
from llmserve_proto import SamplingParams

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
MOE_CONFIGS = {
    # top-2 of 8, renormalised, layer 1 dense; GQA 2, separate lm_head
    "e8-top2-mlp-only": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3,
                             mlp_only_layers=[1], tie_word_embeddings=False),
    # top-4 of 16, raw weights, every second layer sparse; MHA
    "e16-top4-step2": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, num_hidden_layers=4,
                           decoder_sparse_step=2, num_attention_heads=4, num_key_value_heads=4),
}
# The first config runs every schedule of the dense engine's test; the second the ones that stress the most.
CASES = [("e8-top2-mlp-only", s) for s in SCHEDULES] + \
        [("e16-top4-step2", s) for s in ("plain", "async-chunked-preempting", "async-graphs-chunked-preempting")]


@pytest.fixture(scope="module")
def moe_case(make_random_qwen3_dir):
    from transformers import Qwen3MoeForCausalLM
    cases = {}

    def get(name):
        if name not in cases:
            path = make_random_qwen3_dir(seed=7, moe=True, initializer_range=0.1, **MOE_CONFIGS[name])
            hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            prompts = make_prompts(hf.config.vocab_size, seed=1)
            cases[name] = path, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]
        return cases[name]
    return get


@pytest.mark.parametrize("name,schedule", CASES)
def test_greedy_matches_transformers(moe_case, name, schedule, monkeypatch):
    path, prompts, expected = moe_case(name)
    cfg = dict(SCHEDULES[schedule])
    if cfg.pop("step_graphs", False):
        monkeypatch.setenv("LLMSERVE_CPU_STEP_GRAPHS", "1")
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", **cfg))
    for _ in range(2):              # the second pass hits the prefix cache where it is on
        assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    if "preempting" in schedule:
        assert engine.stats()["num_preemptions"] > 0
    if "graphs" in schedule:
        assert engine.runner.graphs.replays > 0
    if schedule == "plain":
        assert engine.stats()["prefix_hit_rate"] > 0
    assert_all_blocks_free(engine)


SPEC_MODES = {
    "chain": dict(speculative_gamma=3),
    "tree-dynamic": dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6),
}
SPEC_SCHEDULES = {
    "plain": dict(block_size=8),
    "chunked-tiny-budget": dict(max_num_batched_tokens=7, max_num_seqs=3),
    "preempting-pool": dict(num_kv_blocks=24, block_size=4),
    "graphs": dict(step_graphs=True),
}


@pytest.mark.parametrize("schedule", list(SPEC_SCHEDULES))
@pytest.mark.parametrize("mode", list(SPEC_MODES))
def test_eagle3_over_a_moe_target_keeps_greedy_output(moe_case, tmp_path_factory, mode, schedule, monkeypatch):
    """A random draft (mostly rejected) reading aux states of layers its config names, one of them a
    sparse layer's input: the target's greedy tokens, every step verified through the experts."""
    path, prompts, expected = moe_case("e8-top2-mlp-only")
    draft = make_tiny_draft(tmp_path_factory.mktemp("draft"), path, seed=1, aux_layer_ids=[0, 1, 2])
    cfg = dict(SPEC_SCHEDULES[schedule])
    if cfg.pop("step_graphs", False):
        monkeypatch.setenv("LLMSERVE_CPU_STEP_GRAPHS", "1")
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", speculative_model=draft,
                                 speculative_policy="always", **SPEC_MODES[mode], **cfg))
    assert engine.spec.proposer.aux_layer_ids == (0, 1, 2)
    for _ in range(2):
        assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    assert engine.stats()["spec_num_drafted_steps"] > 0
    if "preempting" in schedule:
        assert engine.stats()["num_preemptions"] > 0
    assert_all_blocks_free(engine)


# ---- the speculation policy prices a MoE verify step ------------------------------------------------------

class ExpertClock:
    """The engine's clock on a made-up device that prices each sparse layer's call at `per_layer` plus
    `per_expert` for each distinct expert its routing selected: with per_expert dominant, a memory-bound
    MoE, where a step costs the experts it reads (a verify of k + 1 rows a request reads more than a
    decode step's k experts); with per_expert 0, a dense model's flat step cost."""

    def __init__(self, per_layer: float, per_expert: float):
        self.per_layer, self.per_expert, self.now = per_layer, per_expert, 0.0

    def perf_counter(self) -> float:
        return self.now

    def route(self, logits, top_k, renormalize):
        weights, ids = route_reference(logits, top_k, renormalize)
        self.now += self.per_layer + self.per_expert * ids.unique().numel()
        return weights, ids


@pytest.mark.parametrize("priced", ["experts", "flat"])
def test_the_policy_prices_verify_steps_by_the_experts_they_read(make_random_qwen3_dir, tmp_path, monkeypatch,
                                                                  priced):
    """The adaptive policy times every steady step per (batch bucket, verify width): on a MoE target whose
    steps cost the experts they read, a verify of 2-4 rows reads more experts a layer than a decode's 2 and
    costs more than drafts accepted 40% of the time emit, so the policy stops drafting (probes aside); with
    the same acceptance and flat step costs it keeps drafting."""
    from llmserve_core.engine import engine as engine_module
    from llmserve_core.layers import moe as moe_layer
    from llmserve_core.speculative.policy import AcceptanceModel
    path = make_random_qwen3_dir(seed=7, moe=True, initializer_range=0.1, **MOE_CONFIGS["e8-top2-mlp-only"])
    draft = make_tiny_draft(tmp_path / "draft", path, seed=1)
    clock = ExpertClock(*((0.1, 1.0) if priced == "experts" else (1.0, 0.0)))
    monkeypatch.setattr(moe_layer, "route_reference", clock.route)
    monkeypatch.setattr(engine_module, "time", clock)
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", speculative_model=draft,
                                 speculative_gamma=3, speculative_policy="adaptive"))
    # 40% of each draft accepted, whatever the random draft does: 1.4, 1.56, 1.62 tokens a step at depth 1-3.
    engine.policy.acceptance = AcceptanceModel(3, prior=0.4, prior_weight=1e9)
    engine.generate([[5, 9, 2, 7, 11]], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    policy, costs = engine.policy, engine.step_costs.median
    drafted, plain = policy.num_drafted_steps, policy.num_plain_steps
    measured = [(depth, costs[(1, width)] / costs[(1, 1)]) for depth, width in policy.widths.items()
                if (1, width) in costs]
    assert measured
    if priced == "experts":
        for depth, ratio in measured:                    # each depth tried was measured to lose
            assert ratio * (1 + policy.switch_margin) > policy.acceptance.expected_emitted(depth), depth
        assert plain > 3 * drafted and policy.last.gamma == 0
    else:
        assert all(ratio == 1.0 for _, ratio in measured)
        assert drafted > 3 * plain and policy.last.gamma > 0


def test_warm_up_meets_every_rows_bucket_of_the_experts(make_random_qwen3_dir, monkeypatch):
    """The MoE kernels pick tiles per power-of-two rows bucket: the warm-up runs the experts at every bucket
    up to the token budget, also where no single prompt can be that long (several fill a step)."""
    from llmserve_core.kernels.fused_moe import rows_bucket
    from llmserve_core.layers import moe as moe_layer
    seen = set()
    forward = moe_layer.SparseMoeBlock.forward

    def recording(self, x, live_rows=None):
        seen.add(rows_bucket(x.shape[0]))
        return forward(self, x, live_rows)
    monkeypatch.setattr(moe_layer.SparseMoeBlock, "forward", recording)
    path = make_random_qwen3_dir(seed=7, moe=True, **MOE_CONFIGS["e8-top2-mlp-only"])
    Engine(EngineConfig(model=path, device="cpu", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=40,
                        warmup=True))
    assert seen >= {1 << i for i in range(9)}, sorted(seen)
