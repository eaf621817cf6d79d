"""The verify path every speculation method shares: one target forward over the whole batch (prefill
chunks and plain decodes as without speculation, plus each drafting request's verify rows: its last
token, then its drafts), greedy verification or lossless rejection sampling of those rows, and a tree's
accepted path moved into consecutive KV slots.

The forward captures the target's aux hidden states the proposer reads (none for a method without a
model). A pure verify batch, the steady state of decoding, replays the verify graph; under tensor
parallelism that graph is one of the runner's mirrored ones, replayed on every rank.
"""
from __future__ import annotations

import numpy as np
import torch

from llmserve_core.engine.prompt_logprobs import PromptRows
from llmserve_core.engine.request import Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.engine.spec.proposer import Proposal, SpecContext, Verified
from llmserve_core.engine.step_graphs import StepGraphs
from llmserve_core.speculative.tree import TreeVerifyOutput, tree_greedy_verify, tree_kv_moves, tree_rejection_verify
from llmserve_core.speculative.verify import VerifyOutput, greedy_verify, rejection_sample_verify, verify_probs


class Layout:
    """Where each request's rows landed in the packed target forward."""

    def __init__(self):
        self.starts: list[int] = []             # first row of each scheduled request
        self.sample_rows: torch.Tensor | None = None     # [S] plain rows to sample (device)
        self.sample_requests: list[Request] = []
        self.verify_rows: torch.Tensor | None = None     # [D] first verify row of each drafting request (device)
        self.prompt = PromptRows()                      # rows scoring prompt tokens (prompt logprobs)


class Verifier:
    def __init__(self, ctx: SpecContext, aux_layer_ids: tuple[int, ...]):
        self.ctx, self.runner = ctx, ctx.runner
        self.aux_layer_ids = aux_layer_ids
        self.verify_width = ctx.shape.verify_width      # target rows of a full-depth drafting request
        self.offsets = torch.arange(self.verify_width, device=ctx.device)
        self.graph: StepGraphs | None = None

    def capture(self) -> None:
        """The verify forward's graph, one of the runner's mirrored graphs (every tensor-parallel rank
        captures it, after the same ones, and replays it when rank 0 does)."""
        shape, w = self.ctx.shape, self.verify_width
        # A dynamic tree's mask changes every step: the graph takes it as an input (this is its initial value).
        mask = (shape.static_tree.attention_mask(self.ctx.device) if shape.static_tree is not None else
                torch.ones(w, w, dtype=torch.bool).tril() if shape.dynamic is not None else None)
        self.graph = self.runner.model_graphs("verify", self.forward, w, tree_mask=mask, **self.ctx.graph_args())

    def forward(self, ids, _hidden, batch):
        """The verify forward as graphs capture it: (logits of every row, *aux hidden states)."""
        hidden, aux = self._target(ids, batch)
        return (self.runner.model.compute_logits(hidden), *aux)

    def _target(self, ids, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The target's forward: (hidden, its states at aux_layer_ids; none for a proposer reading none)."""
        if not self.aux_layer_ids:
            return self.runner.model(ids, batch, self.runner.kv_caches), []
        return self.runner.model(ids, batch, self.runner.kv_caches, aux_layer_ids=self.aux_layer_ids)

    # ---- the target forward ------------------------------------------------------------------------
    def target_forward(self, sched: ScheduledBatch, drafting: list[Request], proposal: Proposal):
        """-> (hidden, aux, layout, logits): logits of the verify rows where the verify graph ran (hidden
        is None then), else None and every row's hidden state."""
        b = self.ctx.builder
        layout = Layout()
        verify_rows, sample_rows = self._add_rows(sched, drafting, proposal, layout)
        # Only a pure verify (every request drafting, at a depth the warm-up ran) takes the decode kernel's
        # rows path; a prefill chunk's length is the prompt's, a row count no warm-up can cover.
        built = b.finish((verify_rows, sample_rows) + layout.prompt.extras(),
                         uniform_rows=len(verify_rows) == len(sched.requests))
        batch, ids = built.batch, built.input_ids
        layout.verify_rows, layout.sample_rows = built.extras[:2]
        layout.prompt.placed(built.extras[2:])
        width = proposal.width
        if drafting:
            rows = (layout.verify_rows[:, None] + self.offsets[:width]).flatten()
            # A tree's node 0 is the root.
            drafts = proposal.tokens if proposal.trees is None else proposal.tokens[:, 1:]
            ids[rows.view(len(drafting), width)[:, 1:].flatten()] = drafts.flatten()
            if isinstance(proposal.depths, torch.Tensor):
                batch.positions.index_add_(0, rows, proposal.depths.flatten())
                batch.positions.clamp_(max=self.ctx.max_model_len - 1)
        if (len(drafting) == len(sched.requests) and width == self.verify_width and self.graph is not None
                and self.graph.fits(batch)):
            # A pure verify batch (the steady state of decoding): logits come out of the graph.
            logits, *aux = self.runner.run_graphs(self.graph, ids, batch)
            return None, aux, layout, logits
        hidden, aux = self._target(ids, batch)
        return hidden, aux, layout, None

    def _add_rows(self, sched: ScheduledBatch, drafting: list[Request], proposal: Proposal, layout: Layout):
        """Add every scheduled request's rows to the builder: -> (verify rows, sample rows) on the host."""
        drafting_ids = {r.request_id for r in drafting}
        width = proposal.width
        b = self.ctx.builder
        verify_rows, sample_rows = [], []
        device_depths = isinstance(proposal.depths, torch.Tensor)
        for req, n in zip(sched.requests, sched.num_new_tokens):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            if req.request_id in drafting_ids:
                # The last token (n == 1) then the drafts; their ids are filled in on the device.
                ids = [req.token_ids[start]] + [0] * (width - 1)
                if proposal.trees is None:
                    row = b.add(req.block_ids, start, width, ids)
                else:
                    i = len(verify_rows)
                    rope = start if device_depths else start + proposal.depths[i]
                    row = b.add_rows(req.block_ids, rope, np.arange(start, start + width), start + width, ids,
                                     mask=proposal.masks[i])
                verify_rows.append(row)
            else:
                row = b.add(req.block_ids, start, n, req.token_ids[start:end])
                layout.prompt.add(req, row, start, n)
                if end == req.num_tokens:
                    sample_rows.append(row + n - 1)
                    layout.sample_requests.append(req)
            layout.starts.append(row)
        return verify_rows, sample_rows

    # ---- verification ------------------------------------------------------------------------------
    def verify(self, hidden, logits, rows: torch.Tensor | None, drafting: list[Request], proposal: Proposal,
               depth: int) -> Verified:
        """Accept each drafting request's drafts: greedily where every request is greedy, else by
        rejection sampling. `logits` of the verify rows, or None: computed from `hidden` at `rows`."""
        if not drafting:
            return Verified([], [])
        width = proposal.width
        if logits is None:
            idx = (rows[:, None] + self.offsets[:width]).flatten()
            logits = self.runner.model.compute_logits(hidden[idx])         # [B * width, V], request-major
        greedy = all(r.params.greedy for r in drafting)
        if not greedy:
            st = self.ctx.sampling(drafting)
            # A tree node's row draws the token after it: at its depth's offset (a seeded row's noise key).
            offsets = (proposal.trees.depths().tolist() if proposal.trees is not None and st.any_seeded
                       else None)
            probs = verify_probs(logits, st.repeat_rows(width, offsets))
        if proposal.trees is not None:
            out = (tree_greedy_verify(proposal.trees, logits, proposal.tokens) if greedy else
                   tree_rejection_verify(proposal.trees, probs, proposal.tokens, None))
            return Verified(*out.lists())
        # Every request's rows are `width` apart, also where it proposed fewer drafts (padding rows).
        num_draft = (torch.full((len(drafting),), depth, dtype=torch.long, device=self.ctx.device)
                     if proposal.lengths is None else self.ctx.staging.ints(proposal.lengths))
        out = (greedy_verify(logits, proposal.tokens, num_draft, row_stride=width) if greedy else
               rejection_sample_verify(probs, proposal.tokens, num_draft, proposal.q, row_stride=width))
        tokens = out.token_lists()
        return Verified(tokens, [None] * len(tokens))

    @staticmethod
    def unpack(rows: list[list[int]], proposal: Proposal) -> Verified:
        """A greedy verification packed on the device (VerifyOutput / TreeVerifyOutput.packed), read back."""
        if proposal.trees is not None:
            return Verified(*TreeVerifyOutput.unpack(rows))
        return Verified(VerifyOutput.unpack(rows), [None] * len(rows))

    def compact(self, drafting: list[Request], verified: Verified) -> None:
        """Trees: move each request's accepted path's target KV to consecutive slots after its context."""
        if not drafting or verified.paths[0] is None:
            return
        src, dst = [], []
        for req, path in zip(drafting, verified.paths):
            table, base = req.block_ids, req.num_computed_tokens
            for a, b in tree_kv_moves(path):
                src.append(self._slot(table, base + a))
                dst.append(self._slot(table, base + b))
        if not src:                  # every path runs straight down the first branch: nothing moves
            return
        staging = self.ctx.staging
        self.runner.move_kv(*staging.copy([np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)]))

    def _slot(self, block_ids: list[int], pos: int) -> int:
        size = self.runner.block_size
        return block_ids[pos // size] * size + pos % size
