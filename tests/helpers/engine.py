"""The engine's schedules, transformers' greedy reference and the block-leak check that several engine test
modules share (the dense and the MoE model's)."""
from __future__ import annotations

import torch

SCHEDULES = {
    "plain": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-tiny-budget": dict(max_num_batched_tokens=7, max_num_seqs=3),
    "no-chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=128, max_model_len=128),
    "preempting-pool": dict(num_kv_blocks=14, block_size=4),
    # Async scheduling runs the same logic on CPU (launch N+1, then read N back), placeholders included.
    "async": dict(async_scheduling=True),
    "async-chunked-preempting": dict(async_scheduling=True, num_kv_blocks=14, block_size=4,
                                     max_num_batched_tokens=7),
    # The decode graph's bookkeeping (StepGraphs, capture off): decode steps load straight into its inputs,
    # the last step's tokens filling the placeholders there, batches padded up to their bucket.
    "async-graphs": dict(async_scheduling=True, step_graphs=True),
    "async-graphs-chunked-preempting": dict(async_scheduling=True, num_kv_blocks=14, block_size=4,
                                            max_num_batched_tokens=7, step_graphs=True),
}


def hf_greedy(hf_model, prompt, max_new):
    """Greedy continuation by full recomputation: the plainest possible reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def assert_all_blocks_free(engine):
    st = engine.stats()
    assert st["running"] == 0 and st["waiting"] == 0
    assert st["used_kv_blocks"] == 0
    assert st["free_kv_blocks"] + st["cached_kv_blocks"] == st["total_kv_blocks"]
    engine.block_manager.check_invariants()
