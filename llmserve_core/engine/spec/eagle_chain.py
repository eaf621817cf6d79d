"""EAGLE-3 chain drafting: after the catch-up's first proposal, one batched single-token draft forward per
further draft, each reading the previous step's pre-norm state. Greedy drafts take the draft's argmax;
with speculative_accept_mode "sample" each draft is drawn (per-request noise, keyed as the verify keys
it) and its distribution kept for rejection sampling."""
from __future__ import annotations

import torch

from llmserve_core.engine.request import Request
from llmserve_core.engine.spec.proposer import FusedStep, Proposal
from llmserve_core.engine.step_graphs import StepGraphs
from llmserve_core.speculative.propose import greedy_propose, sample_propose
from llmserve_core.speculative.shape import DraftShape
from llmserve_core.speculative.verify import greedy_verify


class ChainDrafter:
    def __init__(self, eagle, shape: DraftShape, device: torch.device):
        self.eagle = eagle                  # the EagleProposer: its draft, KV, graphs and batches
        self.depth = shape.depth

    def capture(self, graphs: dict[str, StepGraphs], draft_rows: dict) -> None:
        if self.depth > 1:
            graphs["draft step"] = StepGraphs("draft step", self.eagle.draft_step, 1, **draft_rows)

    def draft(self, drafting: list[Request], logits: torch.Tensor, h: torch.Tensor, depth: int) -> Proposal:
        """`depth` drafts per request from the catch-up's proposal logits and pre-norm states."""
        e = self.eagle
        draft, b = e.draft, e.ctx.builder
        st = e.ctx.sampling(drafting) if e.sample_drafts else None
        tokens, qs = [], []
        for j in range(depth):
            if j:
                for r in drafting:
                    b.add(r.block_ids, r.num_tokens - 2 + j, 1)
                logits, h = e.forward("draft step", e.draft_step, tokens[-1], h, b.finish(uniform_rows=True).batch)
            if st is not None:     # draft j proposes the token at num_tokens + j
                d, q = sample_propose(logits, st.advanced(j), draft.d2t, draft.cfg.vocab_size)
                qs.append(q)
            else:
                d = greedy_propose(logits, draft.d2t)
            tokens.append(d)
        q = torch.stack(qs, 1).flatten(0, 1) if qs else None       # [B * depth, V], request-major as verify packs
        return Proposal(torch.stack(tokens, 1), q)

    def fused_forward(self, ids, hidden, batch):
        """(drafts [B, depth], verify logits, fused aux, greedy verification) from the padded catch-up
        batch. The later forwards' batches follow from it on the device: each request's catch-up ends at
        KV position seq_len - 1 (the root token's), draft step j writes position seq_len - 1 + j, and the
        verify's rows (the root, then the drafts) sit at seq_len .. seq_len + depth, as the step by step
        path builds them. Greedy verification and the aux fusion run on every row here, so a greedy batch
        leaves the graph with one small readback to do; sampled requests verify from the logits outside."""
        e = self.eagle
        width, n = e.catchup_rows, batch.num_seqs
        logits, h, context, live = e.fused_catchup(ids, hidden, batch)
        tokens = [greedy_propose(logits, e.draft.d2t)]
        for j in range(1, self.depth):
            logits, h = e.draft_step(tokens[-1], h, e.continued_batch(batch, context - 1 + j, 1, live))
            tokens.append(greedy_propose(logits, e.draft.d2t))
        drafts = torch.stack(tokens, 1)
        verify_ids = torch.cat([ids.view(n, width)[:, -1:], drafts], 1).flatten()
        verify = e.continued_batch(batch, context, width, live, count_live=True)
        logits, *aux = e.ctx.verify_forward(verify_ids, None, verify)
        out = greedy_verify(logits, drafts, torch.full((n,), self.depth, dtype=torch.long, device=drafts.device))
        return drafts, logits, e.draft.combine_aux(aux), out.packed()

    def fused_step(self, out: tuple[torch.Tensor, ...]) -> FusedStep:
        drafts, logits, fused_aux, emitted = out
        return FusedStep(Proposal(drafts), logits, emitted, kept=fused_aux)
