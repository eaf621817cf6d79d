"""The speculative step: a peer of the model runner that runs the engine's drafting steps (the policy
picks which, speculative/policy.py; the others are plain steps), synchronously (the next step's drafts
need this step's accepted tokens):

  1. the proposer (proposer.py; EAGLE-3: eagle.py) drafts for the requests that draft now;
  2. ONE target forward over the whole batch (verifier.py): prefill chunks and plain decodes as without
     speculation, plus the verify rows of each drafting request;
  3. plain rows are sampled by the ordinary sampler (with their logits processors: requests with
     grammars, penalties, biases or min_tokens never draft, see Engine.add_request, except while a grammar
     waits for its start_after); verify rows go through greedy verification or lossless rejection
     sampling, a run stopping where such a grammar starts; a tree's accepted path is moved into
     consecutive KV slots;
  4. the proposer keeps what its next proposals need (EAGLE: the aux states of the newly valid positions).

A proposer may run steps 1-2 of a steady, pure drafting batch as one graph (run_fused). Every forward is
built by the runner's batch builder (engine/batch_builder.py) and, where its shape is fixed, replayed
from a CUDA graph (engine/step_graphs.py); the step returns the same per-request results as a plain step
(engine/step_result.py).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from llmserve_core.config import EngineConfig
from llmserve_core.engine.block_manager import BlockManager
from llmserve_core.engine.model_runner import ModelRunner
from llmserve_core.engine.request import Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.engine.spec.proposer import Proposal, Proposer, SpecContext, Verified
from llmserve_core.engine.spec.verifier import Verifier
from llmserve_core.engine.step_result import RequestResult, StepHandle
from llmserve_core.speculative.types import TIMING_KEYS, SpecMetrics, SpecStepResult

log = logging.getLogger("llmserve.spec")


class SpecExecutor:
    def __init__(self, config: EngineConfig, runner: ModelRunner, proposer: Proposer, max_model_len: int):
        """`proposer`: loaded (its weights counted) before the runner sized its KV pool."""
        self.config, self.runner, self.proposer = config, runner, proposer
        self.device = runner.device
        self.shape = config.draft_shape()
        self.gamma = self.shape.depth
        self.verify_width = self.shape.verify_width      # target rows of a full-depth drafting request
        self.step_gamma = self.gamma                     # this step's draft depth (the policy may lower a chain's)
        self.staging = runner.staging                    # one step counter for the runner and this executor
        # A builder of its own, so its batches never clobber the scratch of one the runner is building.
        self.builder = runner.batch_builder(config.max_num_batched_tokens, config.max_num_seqs)
        self.metrics = SpecMetrics()
        self.trace = config.speculative_trace
        self.phases = PhaseTimer(self.metrics, self.device.type == "cuda")
        ctx = SpecContext(config, runner, self.shape, max_model_len, self.builder)
        self.verifier = Verifier(ctx, proposer.aux_layer_ids)
        ctx.verify_forward = self.verifier.forward
        proposer.setup(ctx)
        # The proposer's graphs first, then the verify's: under tensor parallelism every rank builds them all
        # in this order, so the ranks reach the verify's capture (collective) together.
        if runner.use_graphs:
            self.verifier.capture()
        log.info("speculative decoding: %s, %s, accept mode %s", proposer.describe(), self.shape.describe(),
                 config.speculative_accept_mode)

    @property
    def graphs(self) -> dict:
        """Every fixed-shape forward of a drafting step, by name: the proposer's and the verify's."""
        verify = {"verify": self.verifier.graph} if self.verifier.graph is not None else {}
        return {**self.proposer.graphs, **verify}

    def policy_widths(self) -> dict[int, int]:
        """Draft depths the policy may pick, with the verify rows each costs a request: a chain may draft
        fewer tokens on any step; a tree is drafted whole or not at all."""
        if self.shape.kind == "chain":
            return {g: g + 1 for g in range(1, self.gamma + 1)}
        return {self.gamma: self.verify_width}

    # ---- every step, plain ones too ------------------------------------------------------------------
    def on_scheduled(self, sched: ScheduledBatch, block_manager: BlockManager) -> None:
        self.proposer.on_scheduled(sched, block_manager)

    def publish(self, req: Request, block_manager: BlockManager) -> None:
        self.proposer.publish(req, block_manager)

    # ---- a drafting step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: ScheduledBatch, gamma: int | None = None) -> StepHandle:
        """One step; `gamma` (chain only) drafts fewer tokens than configured this step."""
        self.step_gamma = self.gamma if gamma is None or self.shape.kind != "chain" else min(gamma, self.gamma)
        self.staging.new_step()
        drafting = self.proposer.drafting(sched)
        self.phases.collect()
        if self.proposer.fused_fits(sched, drafting, self.step_gamma):
            proposal, verified = self._fused_step(drafting)
            handle = StepHandle(sched)
        else:
            proposal, verified, handle = self._step_by_step(sched, drafting)
        results = [SpecStepResult(tokens, drafted, len(tokens) - 1, path) for tokens, drafted, path
                   in zip(verified.tokens, proposal.num_drafts(self.step_gamma), verified.paths)]
        if results:
            self.metrics.record(results)
        if self.trace and log.isEnabledFor(logging.DEBUG):
            self._trace(drafting, proposal, results)
        handle.ready = [RequestResult(req, tokens, extra_computed=len(tokens) - 1)
                        for req, tokens in zip(drafting, verified.tokens)]
        handle.num_accepted = [r.num_accepted for r in results]
        return handle

    def _fused_step(self, drafting: list[Request]) -> tuple[Proposal, Verified]:
        phase = self.phases
        with phase("draft"):          # the draft and the verify in one graph: its time counts as drafting
            fused = self.proposer.run_fused(drafting)
        with phase("accept"):
            if all(r.params.greedy for r in drafting):      # verified inside the graph: one readback
                verified = self.verifier.unpack(fused.emitted.tolist(), fused.proposal)
            else:
                verified = self.verifier.verify(None, fused.logits, None, drafting, fused.proposal, self.step_gamma)
            verified.stop_at_grammars(drafting)
        with phase("kv_update"):
            self.verifier.compact(drafting, verified)
            self.proposer.keep_fused(drafting, verified, fused.kept)
        return fused.proposal, verified

    def _step_by_step(self, sched: ScheduledBatch, drafting: list[Request]) -> tuple[Proposal, Verified, StepHandle]:
        phase = self.phases
        with phase("draft"):
            proposal = self.proposer.propose(sched, drafting, self.step_gamma)
        with phase("verify"):
            hidden, aux, layout, verify_logits = self.verifier.target_forward(sched, drafting, proposal)
        with phase("accept"):
            prompt_scores = self.runner.score_prompts(hidden, layout.prompt)
            sampled = None
            if layout.sample_requests:
                sampled = self.runner.sample(hidden[layout.sample_rows], layout.sample_requests)
                sampled = sampled.to_host(self.runner.pin)
            verified = self.verifier.verify(hidden, verify_logits, layout.verify_rows, drafting, proposal,
                                            self.step_gamma)
            verified.stop_at_grammars(drafting)
        with phase("kv_update"):
            self.verifier.compact(drafting, verified)
            self.proposer.keep(sched, drafting, verified, aux, layout.starts)
        handle = StepHandle(sched, sampled, layout.sample_requests)
        if prompt_scores is not None:
            handle.set_prompt_scores(layout.prompt.spans, prompt_scores)
        return proposal, verified, handle

    def _trace(self, drafting: list[Request], proposal: Proposal, results: list[SpecStepResult]) -> None:
        with self.metrics.timer("trace"):            # host work only
            drafts = proposal.tokens.tolist()
            for req, res, d in zip(drafting, results, drafts):
                log.debug("spec %s at %d: drafts %s accepted %d emitted %s%s", req.request_id, req.num_tokens,
                          d, res.num_accepted, res.token_ids,
                          f" path {res.accepted_nodes}" if res.accepted_nodes else "")

    # ---- reporting ---------------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        self.phases.collect()
        self.metrics = SpecMetrics()
        self.phases = PhaseTimer(self.metrics, self.device.type == "cuda")

    def stats(self) -> dict:
        """Scalar spec_* counters and rates (the protocol's stats carry scalars only)."""
        self.phases.collect()
        m = self.metrics
        out = {k: v for k, v in m.as_dict().items() if isinstance(v, (int, float))}
        out["spec_num_emitted_tokens"] = m.num_emitted_tokens
        for j, rate in enumerate(m.per_position_acceptance, start=1):
            out[f"spec_acceptance_pos_{j}"] = rate
        for key in TIMING_KEYS:
            out[f"spec_time_{key}_ms"] = 1000.0 * m.timings[key]
        return out


class PhaseTimer:
    """Time per step phase without stalling the device: on CUDA, events at the phase boundaries, read
    once they have completed (a step later at most), so the host keeps queueing work while the GPU runs.
    On the CPU, plain wall-clock timers."""

    def __init__(self, metrics: SpecMetrics, cuda: bool):
        self.metrics, self.cuda = metrics, cuda
        self.unread: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def __call__(self, key: str):
        if not self.cuda:
            with self.metrics.timer(key):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.unread.append((key, start, end))

    def collect(self) -> None:
        waiting = []
        for key, start, end in self.unread:
            if end.query():
                self.metrics.add_time(key, start.elapsed_time(end) / 1000.0)
            else:
                waiting.append((key, start, end))
        self.unread = waiting
