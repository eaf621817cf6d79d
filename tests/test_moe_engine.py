"""A Qwen3-MoE model served by the in-process Engine, float32 on CPU: greedy outputs token-exact against
transformers' Qwen3MoeForCausalLM whatever the scheduling (chunked prefill, prefix hits, preemption, async
scheduling, the decode graphs' bookkeeping), and with an EAGLE-3 draft drafting over it."""
from __future__ import annotations

import pytest
import torch

from helpers.engine import SCHEDULES, assert_all_blocks_free, hf_greedy
from helpers.models import make_prompts
from llmserve_core import Engine, EngineConfig
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
