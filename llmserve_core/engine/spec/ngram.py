"""Prompt lookup (n-gram) speculation: drafts copied from the request's own tokens (the index and the
lookup: speculative/ngram.py). No model, no KV, no device work: a proposal is host work, a few
microseconds a request, and one copy of the drafts to the device.

Every speculative decoding request drafts at the step's depth; one whose suffix has no earlier
occurrence (or whose index still catches up on a long prompt) proposes zero drafts. It keeps its verify
rows, padded, and verification accepts none of them (Proposal.lengths): it emits the target's own token
from its first row, as a plain decode would. Padding instead of dropping it to one plain row keeps every
request at the same row count, so a decoding batch stays one verify graph; the rows cost little where
decoding is memory-bound, and where they do cost (large batches) the policy sees it in the measured step
time, while the unmatched requests count as rejections at the first position of its acceptance model.
"""
from __future__ import annotations

import numpy as np

from llmserve_core.config import EngineConfig
from llmserve_core.engine.block_manager import BlockManager
from llmserve_core.engine.request import Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.engine.spec.proposer import Proposal, Proposer
from llmserve_core.speculative.ngram import NgramIndex, extend_all

# N-grams a step indexes over the batch for requests catching up on a long run (a prompt, or many tokens
# after a long stretch of plain steps: 10-15 ms of host work on a slow core); a request that lags by
# at most STEADY tokens always catches up.
INDEX_BUDGET = 1 << 15
STEADY = 64


class NgramProposer(Proposer):
    # What a drafting step costs beyond a plain one, per draft, until measured: verify rows only.
    prior_cost_per_draft = 0.1

    def __init__(self, config: EngineConfig):
        super().__init__()
        self.lo, self.hi = config.lookup_bounds()

    def describe(self) -> str:
        return f"prompt lookup (n-grams of {self.lo} to {self.hi} tokens)"

    def on_scheduled(self, sched: ScheduledBatch, block_manager: BlockManager) -> None:
        """Every step: index each speculative request's tokens known on the host (placeholders of a step
        still in flight come next time), the whole batch in one pass. The index outlives preemption:
        tokens never change."""
        budget = INDEX_BUDGET // (self.hi - self.lo + 1)
        indexes, sequences, ends = [], [], []
        for req in sched.requests:
            if not req.speculative:
                continue
            index = req.spec_state
            if index is None:
                index = req.spec_state = NgramIndex(self.lo, self.hi)
            lag = req.num_tokens - req.num_pending - index.length
            if lag > STEADY:
                lag = min(lag, budget)
                budget -= lag
            if lag > 0:
                indexes.append(index)
                sequences.append(req.token_ids)
                ends.append(index.length + lag)
        extend_all(indexes, sequences, ends)

    def propose(self, sched: ScheduledBatch, drafting: list[Request], depth: int) -> Proposal:
        if not drafting:
            return Proposal.empty(self.ctx.device)
        flat, lengths = [], []
        for req in drafting:
            index = req.spec_state
            drafts = index.propose(req.token_ids, depth) if index.length == req.num_tokens else []
            flat += drafts
            flat += [0] * (depth - len(drafts))          # padding: never accepted (lengths)
            lengths.append(len(drafts))
        tokens = self.ctx.staging.ints(np.asarray(flat, dtype=np.int64).reshape(len(drafting), depth))
        return Proposal(tokens, lengths=lengths)
