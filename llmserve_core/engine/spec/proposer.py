"""The seam between how drafts are made and everything else a speculative step does.

A speculation method is a Proposer. On each drafting step the executor (executor.py) asks it which of the
batch's requests draft now and for their drafts (a Proposal: a chain of tokens, or a tree of candidates).
Everything after is shared by every method: the one target forward with the verify rows, greedy
verification or lossless rejection sampling (verifier.py; drafts chosen deterministically count as
one-hot), a tree's KV compaction, the step's results and metrics, the verify forward's CUDA graphs, the
adaptive policy's depths and each request's `speculative: false`.

EAGLE-3 (eagle.py) and prompt lookup (ngram.py) are the methods. A method subclasses Proposer and overrides
what it needs, often `propose` alone: the defaults fit a method with no model, no KV and no per-request
state. A chain proposal may give requests fewer drafts than the step's depth (Proposal.lengths).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from llmserve_core.config import EngineConfig
from llmserve_core.engine.batch_builder import BatchBuilder
from llmserve_core.engine.block_manager import BlockManager
from llmserve_core.engine.model_runner import ModelRunner
from llmserve_core.engine.request import Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.engine.step_graphs import StepGraphs
from llmserve_core.layers.sampler import SamplingTensors
from llmserve_core.speculative.shape import DraftShape
from llmserve_core.speculative.tree import TreeBatch

# Verify graphs hold logits for (1 + depth) rows per request: past this batch the step runs eagerly.
MAX_GRAPH_BATCH = 128


@dataclass
class Proposal:
    """The drafts of a step's drafting requests, in their order."""
    tokens: torch.Tensor                # chain: [B, depth] draft ids; tree: [B, nodes] node tokens (node 0: the root)
    # chain, sampled drafts: [B * depth, V] the distribution each was drawn from (None: chosen deterministically)
    q: torch.Tensor | None = None
    trees: TreeBatch | None = None      # trees: each request's parents
    depths: np.ndarray | torch.Tensor | None = None   # trees: [B, nodes] node depths (host for a static tree)
    masks: torch.Tensor | None = None   # trees: [B, nodes, nodes] ancestor masks
    # chain: drafts each request proposed, where some propose fewer than `depth` (the rest of its row is
    # padding, which verification never accepts); None: every request proposed `depth`
    lengths: list[int] | None = None

    def num_drafts(self, depth: int) -> list[int]:
        """Drafts proposed per request along its verified chain (a tree: its depth)."""
        return self.lengths if self.lengths is not None else [depth] * self.tokens.shape[0]

    @property
    def width(self) -> int:
        """Verify rows per drafting request: the root and its drafts."""
        return self.tokens.shape[1] + (0 if self.trees is not None else 1)

    @staticmethod
    def empty(device) -> "Proposal":
        return Proposal(torch.zeros(0, 0, dtype=torch.long, device=device))


@dataclass
class Verified:
    tokens: list[list[int]]             # per drafting request: accepted drafts, then the correction / bonus
    paths: list[list[int] | None]       # tree: accepted node indices, root first

    def stop_at_grammars(self, drafting: list[Request]) -> None:
        """A run that ends a request's reasoning stops after the marker: the grammar holds from there on,
        and verification sampled the tokens after it without the grammar's mask. The next (plain) step
        samples the first of them under the mask, from the same logits: exact, greedy or sampled."""
        for i, req in enumerate(drafting):
            if req.grammar is None:
                continue
            keep = req.grammar.unmasked_run(self.tokens[i])
            self.tokens[i] = self.tokens[i][:keep]
            if self.paths[i] is not None:
                self.paths[i] = self.paths[i][:keep]


@dataclass
class FusedStep:
    """What a proposer's graph of the whole steady step (drafts, then the verify) returned."""
    proposal: Proposal
    logits: torch.Tensor                # the verify rows' logits, request-major
    emitted: torch.Tensor               # greedy verification, packed for one readback
    kept: object                        # what keep_fused() needs of the graph's outputs


@dataclass
class SpecContext:
    """What the executor shares with its proposer once the KV pool exists."""
    config: EngineConfig
    runner: ModelRunner
    shape: DraftShape
    max_model_len: int
    builder: BatchBuilder               # the step's batches, drafting and verify, over the runner's staging
    # The target's verify forward, (ids, hidden, batch) -> (logits, *aux hidden states), for a proposer's
    # graph of the whole step: set by the executor once its verifier exists.
    verify_forward: Callable | None = None

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def staging(self):
        return self.runner.staging

    def graph_args(self) -> dict:
        """StepGraphs arguments every fixed-shape forward of a drafting step shares."""
        runner = self.runner
        return dict(max_batch=min(self.config.max_num_seqs, MAX_GRAPH_BATCH),
                    max_blocks_per_seq=runner.max_blocks_per_seq, max_seq_len=self.max_model_len + self.shape.lookahead,
                    device=self.device, dtype=runner.dtype)

    def sampling(self, reqs: list[Request]) -> SamplingTensors:
        """Rows at each request's next token (verify row j and draft j draw the token j places later)."""
        return SamplingTensors.from_params([r.params for r in reqs], self.device, pin=self.runner.pin,
                                           positions=[r.num_tokens for r in reqs])


class Proposer:
    """How drafts are made. The executor calls, per step: drafting(), then either propose() or, where
    fused_fits(), run_fused(); after verification keep() (or keep_fused()); and for every step, plain
    ones too, on_scheduled() and publish()."""

    # Target layers whose hidden states the method reads: the verify forward returns them (as `aux`).
    aux_layer_ids: tuple[int, ...] = ()
    # The adaptive policy's guess, until it has measured, of what a drafting step costs beyond a plain one
    # per draft (as a share of the plain step): a draft model's forwards and the verify rows.
    prior_cost_per_draft: float = 0.25

    def __init__(self):
        self.graphs: dict[str, StepGraphs] = {}      # the method's fixed-shape forwards, by name
        self.ctx: SpecContext | None = None

    def kv_bytes_per_block(self, runner: ModelRunner) -> int:
        """KV the method keeps per target block (its pool shares the target's block ids), so the runner
        sizes the pools together. Asked before setup()."""
        return 0

    def setup(self, ctx: SpecContext) -> None:
        """Once the KV pool exists: allocate what its size decides, capture graphs (where runner.use_graphs)."""
        self.ctx = ctx

    def describe(self) -> str:
        return type(self).__name__

    # ---- per request -----------------------------------------------------------------------------
    def on_scheduled(self, sched: ScheduledBatch, block_manager: BlockManager) -> None:
        """Every step, plain ones too, after scheduling: start the state of requests new or readmitted
        (sched.preempted lost their KV)."""

    def publish(self, req: Request, block_manager: BlockManager) -> None:
        """After every step: publish the request's newly full blocks to the prefix cache."""
        block_manager.cache_full_blocks(req)

    # ---- a drafting step ---------------------------------------------------------------------------
    def drafting(self, sched: ScheduledBatch) -> list[Request]:
        """The scheduled requests that draft in this step: speculative ones that decode."""
        return [r for r in sched.requests if r.speculative and not r.is_prefilling]

    def propose(self, sched: ScheduledBatch, drafting: list[Request], depth: int) -> Proposal:
        """Drafts for `drafting` (chain: [len(drafting), depth] tokens; a tree is proposed whole). Called on
        every drafting step, also when no request drafts (EAGLE catches its draft rows up then)."""
        raise NotImplementedError

    def keep(self, sched: ScheduledBatch, drafting: list[Request], verified: Verified, aux: list[torch.Tensor],
             starts: list[int]) -> None:
        """After verification: keep what the next proposals need. aux: the target's hidden states at
        aux_layer_ids over the step's rows; starts: each scheduled request's first row there."""

    # ---- optional: the whole steady step in one graph -------------------------------------------------
    def fused_fits(self, sched: ScheduledBatch, drafting: list[Request], depth: int) -> bool:
        return False

    def run_fused(self, drafting: list[Request]) -> FusedStep:
        raise NotImplementedError

    def keep_fused(self, drafting: list[Request], verified: Verified, kept: object) -> None:
        """keep() for a fused step (a tree's accepted KV is already moved into place)."""
