"""EAGLE-3 speculative decoding: a peer of the model runner that owns the draft head and the draft KV.

It borrows the runner's target model and KV caches and runs the engine's drafting steps (the policy
picks which, speculative/policy.py; the others are plain steps), synchronously (the next step's drafts
need this step's accepted tokens):

  1. draft catch-up: one batched draft forward over, for each speculative request of the batch, the
     positions whose target aux states are known but whose draft rows are not computed yet (the last
     step's accepted tokens, or the last prefill chunk). A decoding request's last row proposes d1;
  2. chain: gamma - 1 more batched single-token draft steps; static tree: one draft forward per tree
     level; dynamic tree: one draft forward per level over the frontiers grown so far (dynamic_tree.py);
  3. ONE target forward over the whole batch: prefill chunks and plain decodes as without speculation,
     plus the verify rows of each drafting request (the last token, then its drafts), capturing the
     aux hidden states the draft reads;
  4. plain rows are sampled by the ordinary sampler (with their logits processors: requests with
     grammars, penalties, biases or min_tokens never draft, see Engine.add_request, except while a grammar
     waits for its start_after); verify rows go through greedy verification or lossless rejection
     sampling, a run stopping where such a grammar starts; a tree's accepted path is moved into
     consecutive KV slots;
  5. the aux states of the newly valid positions wait in the request's SpecState for step 1 of the
     request's next step.

Alignment: the draft row at position p reads token p + 1 and the target's aux state at p, so it
proposes token p + 2. The draft KV is a one-layer pool with the target's num_blocks and block_size,
addressed through the target's block tables, so allocation, preemption and the prefix cache cover it
too. KV written at rejected positions (target or draft) lies beyond num_computed_tokens and is simply
overwritten by a later step. The algorithms (proposal, verification, trees) live in speculative/.

Every forward is built by the runner's batch builder (engine/batch_builder.py) from per-sequence spans
and, where its shape is fixed, replayed from a CUDA graph (engine/step_graphs.py); the step returns the
same per-request results as a plain step (engine/step_result.py).
"""
from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from llmserve_core.config import EngineConfig
from llmserve_core.engine.request import Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.engine.step_graphs import StepGraphs
from llmserve_core.engine.prompt_logprobs import PromptRows
from llmserve_core.engine.step_result import RequestResult, StepHandle
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.layers.sampler import SamplingTensors
from llmserve_core.models.eagle3 import load_eagle3
from llmserve_core.speculative.dynamic_tree import TreeGrowth
from llmserve_core.speculative.propose import greedy_propose, sample_propose, topk_propose
from llmserve_core.speculative.tree import TreeBatch, TreeVerifyOutput, fill_level, tree_greedy_verify, tree_kv_moves, \
    tree_rejection_verify
from llmserve_core.speculative.types import TIMING_KEYS, SpecMetrics, SpecStepResult
from llmserve_core.speculative.verify import VerifyOutput, greedy_verify, rejection_sample_verify, verify_probs

log = logging.getLogger("llmserve.eagle")

# Verify graphs hold logits for (1 + gamma) rows per request: past this batch the step runs eagerly.
MAX_GRAPH_BATCH = 128


def lookahead_tokens(config: EngineConfig) -> int:
    """KV slots a drafting request needs beyond its next token: its drafts (chain) or tree nodes."""
    if config.speculative_model is None:
        return 0
    return config.draft_shape().lookahead


def load_draft(config: EngineConfig, runner, max_positions: int):
    """The draft head, sharing the target's embedding (and head, if it has none of its own)."""
    embed, lm_head = runner.model.vocab_weights()
    return load_eagle3(config.speculative_model, runner.attn_backend, runner.dtype, runner.device,
                       target_embed=embed, target_lm_head=lm_head, load_format=config.load_format,
                       seed=config.seed, max_positions=max_positions)


@dataclass
class SpecState:
    """A request's draft progress. Draft KV rows below draft_pos are written; `pending` holds the fused
    aux states of positions draft_pos .. num_computed_tokens - 1, whose draft rows wait for the token
    after them (known by the time the request is next scheduled). Requests that do not draft keep one
    too, so the blocks they publish carry draft rows.

    Gaps: a plain step (the adaptive policy's "no drafting") computes target KV without aux states, so
    those positions never get draft rows. Rows from first_invalid on (None: no gap) are therefore not
    what the draft would have computed: later draft forwards read them anyway, which costs acceptance
    but never exactness (verification decides every token). The prefix cache keeps this honest: blocks
    are published with a flag saying whether their draft rows are valid (below valid_until), and a
    request served from the cache starts its first_invalid at the first block without."""
    draft_pos: int | None = None        # None: not started (new, or preempted and readmitted)
    pending: torch.Tensor | None = None
    first_invalid: int | None = None

    def start(self, num_computed: int, valid_prefix: int) -> None:
        """Begin at num_computed (the prefix cache's hit, or 0); draft rows below valid_prefix are valid."""
        self.draft_pos, self.pending = num_computed, None
        self.first_invalid = valid_prefix if valid_prefix < num_computed else None

    def sync(self, num_computed: int) -> None:
        """Catch up with the request's KV after steps that did not draft: positions draft_pos ..
        num_computed - 1 never got (or, with pending aux dropped, never will get) draft rows."""
        rows = 0 if self.pending is None else self.pending.shape[0]
        if self.draft_pos + rows != num_computed:
            if self.first_invalid is None or self.first_invalid > self.draft_pos:
                self.first_invalid = self.draft_pos
            self.draft_pos, self.pending = num_computed, None

    def publish_limits(self, num_computed: int) -> tuple[int, int]:
        """(publish full blocks below, their draft rows are valid below). Without a gap, blocks wait
        until their draft rows exist (below draft_pos: the pending rows get theirs next step); after a
        gap the rows past it stay invalid, so every computed block may go, flagged."""
        if self.first_invalid is None:
            return self.draft_pos, self.draft_pos
        return num_computed, self.first_invalid


class EagleExecutor:
    def __init__(self, config: EngineConfig, runner, draft, max_model_len: int):
        """`draft`: the loaded head (load_draft), loaded before the runner sized its KV pool."""
        self.config = config
        self.runner = runner
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_model_len = max_model_len
        self.shape = config.draft_shape()
        self.gamma = self.shape.depth
        self.tree = self.shape.static_tree
        self.dynamic = self.shape.dynamic
        self.lookahead = self.shape.lookahead
        self.verify_width = self.shape.verify_width      # target rows of a full-depth drafting request
        self.step_gamma = self.gamma                     # this step's draft depth (the policy may lower a chain's)
        self.draft = draft
        target = runner.model_config
        dcfg = self.draft.cfg
        if dcfg.vocab_size != target.vocab_size or dcfg.target_hidden_size != target.hidden_size:
            raise ValueError(f"speculative_model: the draft expects vocab {dcfg.vocab_size} and target hidden size "
                             f"{dcfg.target_hidden_size}, the target has {target.vocab_size} and {target.hidden_size}")
        if self.dynamic is not None and self.dynamic.topk > dcfg.draft_vocab_size:
            raise ValueError(f"speculative_eagle_topk: {self.dynamic.topk} exceeds the draft's vocabulary "
                             f"({dcfg.draft_vocab_size} tokens)")
        self.aux_layer_ids = dcfg.resolve_aux_layer_ids(target.num_hidden_layers)
        shape = (runner.num_blocks, self.block_size, dcfg.num_key_value_heads, dcfg.head_dim)
        self.kv = (torch.zeros(shape, dtype=runner.dtype, device=self.device),
                   torch.zeros(shape, dtype=runner.dtype, device=self.device))
        # The runner's pinned staging (one step counter for both); a builder of its own for the scratch.
        self.staging = runner.staging
        self.builder = runner.batch_builder(config.max_num_batched_tokens, config.max_num_seqs)
        # Tree candidates are the draft's deterministic top-k, which rejection sampling treats as one-hot q.
        self.sample_drafts = config.speculative_accept_mode == "sample" and self.shape.kind == "chain"
        self.metrics = SpecMetrics()
        self.trace = config.speculative_trace
        self.phases = PhaseTimer(self.metrics, self.device.type == "cuda")
        self.pin = self.device.type == "cuda"
        # Draft-row depths of the tree levels (a static tree's nodes, a dynamic tree's expanded nodes), on
        # the host for batches built there and on the device for batches derived there.
        self.row_depths = (np.asarray(self.tree.depths) if self.tree is not None else
                           self.dynamic.row_depths(self.dynamic.num_expanded).numpy() if self.dynamic is not None else
                           np.zeros(0, dtype=np.int64))
        self.row_depths_device = torch.as_tensor(self.row_depths, device=self.device)
        if self.tree is not None:
            self.tree_mask = self.tree.attention_mask(self.device)
            self.tree_parents = torch.tensor(self.tree.parents, device=self.device)
            self.tree_batch = self.tree.batch(1, self.device)      # expanded per step: no host copy
            self.tree_levels = [torch.tensor(self.tree.level(d), device=self.device) - 1 for d in range(self.tree.depth)]
        # A decoding request catches up on at most the tokens its last step emitted: its accepted drafts
        # plus one. The catch-up graph pads every request to that many rows.
        self.catchup_rows = 1 + (self.tree.depth if self.tree is not None else self.gamma)
        # Greedy chain drafts and trees need nothing from the host between the catch-up and the verify, so
        # a whole steady step (catch-up, draft forwards, verify) can be one graph; sampled chain drafts draw
        # with per-request noise and keep the step by step path. So does tensor parallelism: that
        # graph's verify reads drafts only rank 0's draft computes, so no worker could replay it (and meet
        # its all-reduces); the verify's own graph, its drafts sent in the step broadcast, replays on all.
        self.fused = not self.sample_drafts and runner.tp is None
        self.verify_offsets = torch.arange(max(self.verify_width, self.catchup_rows, self.lookahead + 1), device=self.device)
        self.graphs = self._capture_graphs() if runner.use_graphs else {}
        log.info("EAGLE-3 draft %s: aux layers %s, %s, accept mode %s", config.speculative_model,
                 list(self.aux_layer_ids), self.shape.describe(), config.speculative_accept_mode)

    @staticmethod
    def kv_bytes_per_block(draft, runner) -> int:
        """What one block of the draft's one-layer KV pool costs, so the runner sizes the pools together."""
        cfg = draft.cfg
        return 2 * runner.block_size * cfg.num_key_value_heads * cfg.head_dim * runner.dtype.itemsize

    def _capture_graphs(self) -> dict[str, StepGraphs]:
        """Every fixed-shape forward of a drafting step, keyed by name: the catch-up, the chain's draft
        steps, each tree level's draft forward, the verify. On the CPU (tests) they run eagerly through
        the same buffers and padding. Under tensor parallelism every rank builds them all, so the ranks reach
        the verify's capture (collective) together; only the verify, the target's forward, replays on the
        workers (the draft runs on rank 0)."""
        dcfg, runner = self.draft.cfg, self.runner
        common = dict(max_batch=min(self.config.max_num_seqs, MAX_GRAPH_BATCH),
                      max_blocks_per_seq=runner.max_blocks_per_seq, max_seq_len=self.max_model_len + self.lookahead,
                      device=self.device, dtype=runner.dtype)
        draft_rows = dict(hidden_size=dcfg.hidden_size, capture=self.device.type == "cuda", **common)
        graphs = {"catch-up": StepGraphs("catch-up", self._catchup_forward, self.catchup_rows, **draft_rows)}
        if self.shape.kind == "chain" and self.gamma > 1:
            graphs["draft step"] = StepGraphs("draft step", self._draft_step, 1, **draft_rows)
        if self.fused:
            # The steady state of decoding in one graph, fed the padded catch-up's inputs. It only saves
            # host work: should its capture fail on some device, drafting steps run forward by forward.
            fused = self._chain_step_forward if self.shape.kind == "chain" else self._tree_step_forward
            try:
                graphs["fused step"] = StepGraphs("fused step", fused, self.catchup_rows, **draft_rows)
            except RuntimeError as e:
                log.error("EAGLE-3: the fused step's CUDA graph failed to capture (%s); drafting steps run "
                          "forward by forward", str(e).splitlines()[0] if str(e) else type(e).__name__)
                self.fused = False
        if self.tree is not None:
            for d in range(1, self.tree.depth):
                m = max(self.tree.level(d)) + 1                        # nodes 1..m-1: levels 1..d
                graphs[f"tree level {d}"] = StepGraphs(f"tree level {d}", self._tree_level_forward(d), m - 1,
                                                       tree_mask=self.tree_mask[1:m, 1:m], **draft_rows)
        if self.dynamic is not None:
            k = self.dynamic.topk
            for level in range(1, self.dynamic.num_steps):
                m = k * level                                          # the frontiers of levels 1..level
                graphs[f"dynamic level {level}"] = StepGraphs(
                    f"dynamic level {level}", self._dynamic_level_forward(m), m,
                    tree_mask=torch.ones(m, m, dtype=torch.bool).tril(), **draft_rows)
        # A dynamic tree's mask changes every step: the graph takes it as an input (this is its initial value).
        mask = (self.tree_mask if self.tree is not None else
                torch.ones(self.verify_width, self.verify_width, dtype=torch.bool).tril() if self.dynamic else None)
        graphs["verify"] = runner.model_graphs("verify", self._verify_forward, self.verify_width, tree_mask=mask,
                                               **common)
        return graphs

    def _forward(self, name: str, fn, ids: torch.Tensor, hidden: torch.Tensor | None, batch: ForwardBatch):
        """Through the named graph where the batch has its shape, else eagerly."""
        graphs = self.graphs.get(name)
        if graphs is not None and graphs.fits(batch):
            return graphs.run(ids, hidden, batch)
        return fn(ids, hidden, batch)

    # ---- the step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: ScheduledBatch, gamma: int | None = None) -> StepHandle:
        """One step; `gamma` (chain only) drafts fewer tokens than configured this step."""
        self.step_gamma = self.gamma if gamma is None or self.shape.kind != "chain" else min(gamma, self.gamma)
        self.staging.new_step()
        for req in sched.requests:
            req.spec_state.sync(req.num_computed_tokens)
        # A decoding request has pending rows (its last step's tokens) unless plain steps ran since: then
        # this step only computes its aux states, and it drafts from the next one on.
        drafting = [r for r in sched.requests if r.speculative and not r.is_prefilling and r.spec_state.pending is not None]
        phase = self.phases
        phase.collect()
        sampled, sample_requests, prompt_scores = None, [], None
        if self._fused_step_fits(sched, drafting):
            with phase("draft"):          # the draft and the verify in one graph: its time counts as drafting
                proposal, verify_logits, fused_aux, emitted = self._fused_step(drafting)
            with phase("accept"):
                if all(r.params.greedy for r in drafting):      # verified inside the graph: one readback
                    rows = emitted.tolist()
                    verified = (_Verified(*TreeVerifyOutput.unpack(rows)) if proposal.trees is not None else
                                _Verified(VerifyOutput.unpack(rows), [None] * len(rows)))
                else:
                    verified = self._verify(None, verify_logits, None, drafting, proposal)
                verified.stop_at_grammars(drafting)
            with phase("kv_update"):
                self._keep_fused(drafting, verified, fused_aux)
        else:
            with phase("draft"):
                proposal = self._draft(sched, drafting)
            with phase("verify"):
                hidden, aux, layout, verify_logits = self._target_forward(sched, drafting, proposal)
            with phase("accept"):
                prompt_scores = self.runner.score_prompts(hidden, layout.prompt)
                sample_requests = layout.sample_requests
                if sample_requests:
                    sampled = self.runner.sample(hidden[layout.sample_rows], sample_requests).to_host(self.pin)
                verified = self._verify(hidden, verify_logits, layout.verify_rows, drafting, proposal)
                verified.stop_at_grammars(drafting)
            with phase("kv_update"):
                self._commit(sched, drafting, verified, aux, layout)
        results = [SpecStepResult(tokens, self.step_gamma, len(tokens) - 1, path)
                   for tokens, path in zip(verified.tokens, verified.paths)]
        if results:
            self.metrics.record(results)
        if self.trace and log.isEnabledFor(logging.DEBUG):
            with self.metrics.timer("trace"):            # host work only
                drafts = proposal.tokens.tolist()
                for req, res, d in zip(drafting, results, drafts):
                    log.debug("spec %s at %d: drafts %s accepted %d emitted %s%s", req.request_id, req.num_tokens,
                              d, res.num_accepted, res.token_ids,
                              f" path {res.accepted_nodes}" if res.accepted_nodes else "")
        ready = [RequestResult(req, tokens, extra_computed=len(tokens) - 1) for req, tokens in zip(drafting, verified.tokens)]
        handle = StepHandle(sched, sampled, sample_requests, ready, [r.num_accepted for r in results])
        if prompt_scores is not None:
            handle.set_prompt_scores(layout.prompt.spans, prompt_scores)
        return handle

    def policy_widths(self) -> dict[int, int]:
        """Draft depths the policy may pick, with the verify rows each costs a request: a chain may draft
        fewer tokens on any step; a tree is drafted whole or not at all."""
        if self.shape.kind == "chain":
            return {g: g + 1 for g in range(1, self.gamma + 1)}
        return {self.gamma: self.verify_width}

    # ---- 1-2: drafting -----------------------------------------------------------------------------
    def _draft(self, sched: ScheduledBatch, drafting: list[Request]) -> "_Proposal":
        # Catch-up: draft rows for positions draft_pos .. num_computed - 1, reading the tokens one later.
        pending = [r for r in sched.requests if r.spec_state.pending is not None]
        none = _Proposal(torch.zeros(0, 0, dtype=torch.long, device=self.device))
        if not pending:
            return none
        if self._catchup_pads(self.graphs.get("catch-up"), pending, drafting):
            logits, h = self._catchup_padded(self.graphs["catch-up"], drafting)
        else:
            logits, h = self._catchup_ragged(pending, drafting)
        if not drafting:
            return none
        if self.shape.kind != "chain":
            return self._draft_tree(drafting, logits, h)
        st = self._sampling(drafting) if self.sample_drafts else None
        b = self.builder
        tokens, qs = [], []
        for j in range(self.step_gamma):
            if j:
                for r in drafting:
                    b.add(r.block_ids, r.num_tokens - 2 + j, 1)
                logits, h = self._forward("draft step", self._draft_step, tokens[-1], h,
                                          b.finish(uniform_rows=True).batch)
            if st is not None:     # draft j proposes the token at num_tokens + j
                d, q = sample_propose(logits, st.advanced(j), self.draft.d2t, self.draft.cfg.vocab_size)
                qs.append(q)
            else:
                d = greedy_propose(logits, self.draft.d2t)
            tokens.append(d)
        q = torch.stack(qs, 1).flatten(0, 1) if qs else None       # [B * gamma, V], request-major as verify packs
        return _Proposal(torch.stack(tokens, 1), q)

    def _catchup_ragged(self, pending: list[Request], drafting: list[Request]):
        """One draft forward over every pending row; (logits, pre-norm) of each drafting request's last row
        (its first proposal), or (None, None) when nothing drafts."""
        b = self.builder
        hidden, last_rows = [], {}
        for req in pending:
            st = req.spec_state
            start, end = st.draft_pos, req.num_computed_tokens
            row = b.add(req.block_ids, start, end - start, req.token_ids[start + 1:end + 1])
            hidden.append(st.pending)
            last_rows[req.request_id] = row + end - start - 1
            st.draft_pos, st.pending = end, None
        # Never the decode kernel's rows path: a ragged catch-up's row count follows the prompt or the gap,
        # and that kernel compiles a variant per row count (a compile inside a request).
        built = b.finish(([last_rows[r.request_id] for r in drafting],))
        normed, prenorm = self.draft(built.input_ids, torch.cat(hidden), built.batch, self.kv)
        if not drafting:
            return None, None
        last = built.extras[0]
        return self.draft.compute_logits(normed[last]), prenorm[last]

    def _catchup_pads(self, graphs: StepGraphs | None, pending: list[Request], drafting: list[Request]) -> bool:
        """Whether the catch-up can run padded through `graphs`: every pending request drafts, within the
        graph's buckets, with at most catchup_rows rows to catch up on (its last step's tokens)."""
        return (graphs is not None and graphs.bucket_for(len(drafting)) is not None
                and len(pending) == len(drafting) and all(p is r for p, r in zip(pending, drafting))
                and all(r.num_computed_tokens - r.spec_state.draft_pos <= self.catchup_rows for r in drafting))

    def _catchup_padded(self, graphs: StepGraphs, drafting: list[Request]) -> tuple[torch.Tensor, ...]:
        """Replay `graphs` (the catch-up's, or the fused step's) over the catch-up with each request's span
        padded in front to catchup_rows rows, so its real rows are the last ones and its last row is the
        proposal. A padding row sits at an already computed position (clamped at 0), writes no KV (slot -1),
        and its outputs are dropped; the span never reaches past the request's own KV. The host-built batch
        goes straight into the graph's inputs in one copy, the pending aux rows into its hidden rows (a
        padding row keeps whatever it held: its outputs are never read)."""
        width, n = self.catchup_rows, len(drafting)
        ends = np.fromiter((r.num_computed_tokens for r in drafting), np.int64, n)
        real = ends - np.fromiter((r.spec_state.draft_pos for r in drafting), np.int64, n)    # rows to catch up on
        at = ends[:, None] - width + np.arange(width)                                       # [B, W] positions
        live = at >= ends[:, None] - real[:, None]
        ids, hidden = [], []
        for req, end, k in zip(drafting, ends.tolist(), real.tolist()):
            ids += [0] * (width - k) + req.token_ids[end + 1 - k:end + 1]    # each row reads the token one later
            hidden.append(req.spec_state.pending)
            req.spec_state.draft_pos, req.spec_state.pending = end, None
        self.builder.add_uniform([r.block_ids for r in drafting], np.maximum(at, 0), np.where(live, at, -1), ends,
                                 np.asarray(ids, dtype=np.int64).reshape(n, width))
        dest = np.flatnonzero(live.reshape(-1))
        n = graphs.load(self.builder.finish_host(), dest)
        rows = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        graphs.hidden.index_copy_(0, graphs.extra[:len(dest)], rows)
        return graphs.replay(n)

    # ---- 1-3 in one graph: the steady step ----------------------------------------------------------
    def _fused_step_fits(self, sched: ScheduledBatch, drafting: list[Request]) -> bool:
        """A pure drafting batch at full depth whose catch-up pads: the fused graph's shape."""
        if not (self.fused and drafting and len(drafting) == len(sched.requests) and self.step_gamma == self.gamma):
            return False
        pending = [r for r in sched.requests if r.spec_state.pending is not None]
        return self._catchup_pads(self.graphs.get("fused step"), pending, drafting)

    def _fused_step(self, drafting: list[Request]):
        """Catch-up, draft forwards and verify from one host-built batch and one replay: (proposal, verify
        logits, fused aux of every verify row, greedy verification packed for one readback)."""
        out = self._catchup_padded(self.graphs["fused step"], drafting)
        if self.shape.kind == "chain":
            drafts, logits, fused_aux, emitted = out
            return _Proposal(drafts), logits, fused_aux, emitted
        nodes, parents, logits, fused_aux, emitted = out
        return _Proposal(nodes, trees=self._tree_batch(parents)), logits, fused_aux, emitted

    def _tree_batch(self, parents: torch.Tensor) -> TreeBatch:
        """The verify trees for these parents, with the bounds this executor's tree kind guarantees."""
        if self.tree is not None:
            return dataclasses.replace(self.tree_batch, parents=parents)
        return TreeBatch(parents, self.dynamic.num_steps, self.dynamic.topk, bounded=True)

    def _keep_fused(self, drafting: list[Request], verified: "_Verified", fused_aux: torch.Tensor) -> None:
        """_commit for the fused step, whose graph already fused the aux of every verify row: a chain keeps
        each request's first len(tokens) rows (copied out: the graph's next replay rewrites its outputs),
        a tree the rows of its accepted path, after moving that path's KV into place."""
        width = self.verify_width
        if verified.paths[0] is None:
            fused_aux = fused_aux.clone()
            parts = [fused_aux[i * width:i * width + len(tokens)] for i, tokens in enumerate(verified.tokens)]
        else:
            self._compact_paths(drafting, verified.paths)
            rows = [i * width + node for i, path in enumerate(verified.paths) for node in path]
            parts = fused_aux[self.staging.ints(rows)].split([len(path) for path in verified.paths])
        for req, part in zip(drafting, parts):
            req.spec_state.draft_pos = req.num_computed_tokens
            req.spec_state.pending = part

    def _fused_catchup(self, ids, hidden, batch):
        """The fused step's first forward: (proposal logits, pre-norm of each request's last catch-up row,
        each request's context length [B], whether it is a live request rather than graph padding [B])."""
        logits, h = self._catchup_forward(ids, hidden, batch)
        live = batch.slot_mapping.view(batch.num_seqs, self.catchup_rows)[:, -1] >= 0     # padding writes no KV
        return logits, h, batch.seq_lens.long(), live

    def _chain_step_forward(self, ids, hidden, batch):
        """(drafts [B, gamma], verify logits, fused aux, greedy verification) from the padded catch-up
        batch. The later forwards' batches follow from it on the device: each request's catch-up ends at
        KV position seq_len - 1 (the root token's), draft step j writes position seq_len - 1 + j, and the
        verify's rows (the root, then the drafts) sit at seq_len .. seq_len + gamma, as the step by step
        path builds them. Greedy verification and the aux fusion run on every row here, so a greedy batch
        leaves the graph with one small readback to do; sampled requests verify from the logits outside."""
        width, n = self.catchup_rows, batch.num_seqs
        logits, h, context, live = self._fused_catchup(ids, hidden, batch)
        tokens = [greedy_propose(logits, self.draft.d2t)]
        for j in range(1, self.gamma):
            logits, h = self._draft_step(tokens[-1], h, self._continued_batch(batch, context - 1 + j, 1, live))
            tokens.append(greedy_propose(logits, self.draft.d2t))
        drafts = torch.stack(tokens, 1)
        verify_ids = torch.cat([ids.view(n, width)[:, -1:], drafts], 1).flatten()
        logits, *aux = self._verify_forward(verify_ids, None, self._continued_batch(batch, context, width, live))
        out = greedy_verify(logits, drafts, torch.full((n,), self.gamma, dtype=torch.long, device=drafts.device))
        return drafts, logits, self.draft.combine_aux(aux), out.packed()

    def _tree_step_forward(self, ids, hidden, batch):
        """(node tokens [B, N], parents [B, N], verify logits, fused aux, greedy verification) from the
        padded catch-up batch: the tree grows as on the step by step path, each level's draft rows at KV
        positions seq_len .. seq_len + rows - 1 with rotary positions seq_len - 1 + depth, and the verify's
        nodes at seq_len .. seq_len + N - 1 with rotary positions seq_len + depth."""
        width, n = self.catchup_rows, batch.num_seqs
        logits, h, context, live = self._fused_catchup(ids, hidden, batch)

        def run_level(name, fn, level_ids, level_hidden, depths: slice, mask):
            rows = depths.stop - depths.start
            level = self._continued_batch(batch, context, rows, live,
                                          rope=(context - 1)[:, None] + self.row_depths_device[depths],
                                          tree_mask=mask.flatten(0, 1) if mask.dim() == 3 else mask.repeat(n, 1))
            return fn(level_ids, level_hidden, level)
        trees, nodes = self._grow_tree(logits, h, ids.view(n, width)[:, -1], run_level)
        depths = trees.depths() if self.dynamic is not None else self.row_depths_device.expand(n, -1)
        masks = trees.attention_masks() if self.dynamic is not None else self.tree_mask.expand(n, -1, -1)
        verify = self._continued_batch(batch, context, nodes.shape[1], live, rope=context[:, None] + depths,
                                       tree_mask=masks.flatten(0, 1))
        logits, *aux = self._verify_forward(nodes.flatten(), None, verify)
        out = tree_greedy_verify(trees, logits, nodes)
        return nodes, trees.parents, logits, self.draft.combine_aux(aux), out.packed()

    def _continued_batch(self, batch: ForwardBatch, first: torch.Tensor, rows: int, live: torch.Tensor,
                         rope: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None) -> ForwardBatch:
        """`rows` rows per sequence at KV positions first .. first + rows - 1, in `batch`'s blocks, causal
        or under `tree_mask` ([B * rows, rows]), at rotary positions `rope` ([B, rows]; default: the KV
        positions); sequences not `live` write nothing. Built on the device (no host copy), as
        BatchBuilder.add / add_rows would."""
        kv = first[:, None] + self.verify_offsets[:rows]                                   # [B, rows]
        tables = batch.block_tables
        blocks = tables.gather(1, (kv // self.block_size).clamp(max=tables.shape[1] - 1)).long()
        slots = torch.where(live[:, None], blocks * self.block_size + kv % self.block_size, -1)
        n = first.shape[0]
        rope = kv if rope is None else rope
        return ForwardBatch(
            positions=rope.clamp(max=self.builder.max_position - 1).flatten(), slot_mapping=slots.flatten(),
            query_start_loc=torch.arange(0, (n + 1) * rows, rows, dtype=torch.int32, device=first.device),
            seq_lens=(first + rows).int(), block_tables=tables, max_query_len=rows, max_seq_len=batch.max_seq_len,
            tree_mask=tree_mask, uniform_query_len=rows)

    def _draft_tree(self, drafting: list[Request], logits: torch.Tensor, h: torch.Tensor) -> "_Proposal":
        """A static or dynamic tree grown from level batches built on the host (each request's rows at KV
        positions num_tokens - 1 on, rotary positions num_tokens - 2 + depth), each level's forward through
        its graph where the batch fits one."""
        b = self.builder

        def run_level(name, fn, level_ids, level_hidden, depths: slice, mask):
            rows = depths.stop - depths.start
            for i, r in enumerate(drafting):
                b.add_rows(r.block_ids, r.num_tokens - 2 + self.row_depths[depths],
                           np.arange(r.num_tokens - 1, r.num_tokens - 1 + rows), r.num_tokens - 1 + rows,
                           mask=mask[i] if mask.dim() == 3 else mask)
            return self._forward(name, fn, level_ids, level_hidden, b.finish(uniform_rows=True).batch)
        trees, nodes = self._grow_tree(logits, h, self.staging.ints([r.token_ids[-1] for r in drafting]), run_level)
        if self.dynamic is not None:
            # Node depths stay on the device: the verify batch adds them to its rotary positions there.
            return _Proposal(nodes, trees=trees, depths=trees.depths(), masks=trees.attention_masks())
        return _Proposal(nodes, trees=trees, depths=np.tile(self.row_depths, (len(drafting), 1)),
                         masks=self.tree_mask.expand(len(drafting), -1, -1))

    def _grow_tree(self, logits: torch.Tensor, h: torch.Tensor, roots: torch.Tensor, run_level):
        """(TreeBatch, node tokens [B, N]) from the catch-up's proposal logits and pre-norm states [B, ...]
        and the root tokens [B]. run_level(graph name, forward, ids, hidden, depths, mask) runs one level's
        draft forward; `depths` slices row_depths (the level's rows), mask is [rows, rows] or [B, rows, rows].

        Static tree: level d's forward re-runs every node above it as well (a few rows), so each node sees
        exactly its ancestors through the tree mask. Dynamic tree (speculative/dynamic_tree.py): level d's
        forward runs the frontiers of levels 1..d, each node reading its parent's draft state and seeing
        its ancestors through the growth's mask."""
        n = roots.shape[0]
        if self.dynamic is not None:
            shape = self.dynamic
            growth = TreeGrowth(shape, torch.log_softmax(logits.float(), -1), self.draft.d2t)
            prenorm = h.new_zeros(n, 1 + shape.num_expanded, h.shape[-1])     # 0: the root; e + 1: expanded node e
            prenorm[:, 0] = h
            while not growth.done:
                tokens, source, mask = growth.draft_rows()
                m = tokens.shape[1]
                hidden = prenorm.gather(1, source[:, :, None].expand(-1, -1, prenorm.shape[-1]))
                frontier_logits, pre = run_level(f"dynamic level {m // shape.topk}", self._dynamic_level_forward(m),
                                                 tokens.flatten(), hidden.flatten(0, 1), slice(0, m), mask)
                prenorm[:, 1:m + 1] = pre.view(n, m, -1)
                growth.grow(torch.log_softmax(frontier_logits.float(), -1))
            return growth.finish(roots)
        tree = self.tree
        nodes = torch.zeros(n, tree.num_nodes, dtype=torch.long, device=self.device)
        nodes[:, 0] = roots
        prenorm = h.new_zeros(n, tree.num_nodes, h.shape[-1])
        prenorm[:, 0] = h
        parents = self.tree_parents
        for d in range(tree.depth):
            if d:
                m = max(tree.level(d)) + 1                            # nodes 1..m-1 are levels 1..d
                logits, pre = run_level(f"tree level {d}", self._tree_level_forward(d), nodes[:, 1:m].flatten(),
                                        prenorm[:, parents[1:m]].flatten(0, 1), slice(1, m), self.tree_mask[1:m, 1:m])
                prenorm[:, 1:m] = pre.view(n, m - 1, -1)
            k = tree.max_children(d)
            if k:
                top = topk_propose(logits, k, self.draft.d2t).view(n, len(tree.level(d)), k)
                fill_level(tree, d, top, nodes)
        return self._tree_batch(self.tree_batch.parents.expand(n, -1)), nodes

    # ---- 3: the target forward ---------------------------------------------------------------------
    def _target_forward(self, sched: ScheduledBatch, drafting: list[Request], proposal: "_Proposal"):
        drafting_ids = {r.request_id for r in drafting}
        width = proposal.width
        b = self.builder
        layout = _Layout()
        verify_rows, sample_rows = [], []
        prompt = layout.prompt
        device_depths = isinstance(proposal.depths, torch.Tensor)
        for req, n in zip(sched.requests, sched.num_new_tokens):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            if req.request_id in drafting_ids:
                # The last token (n == 1) then the drafts; their ids are filled in on the device below.
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
                prompt.add(req, row, start, n)
                if end == req.num_tokens:
                    sample_rows.append(row + n - 1)
                    layout.sample_requests.append(req)
            layout.starts.append(row)
        # Only a pure verify (every request drafting, at a depth the warm-up ran) takes the decode kernel's
        # rows path; a prefill chunk's length is the prompt's, a row count no warm-up can cover.
        built = b.finish((verify_rows, sample_rows) + prompt.extras(),
                         uniform_rows=len(verify_rows) == len(sched.requests))
        batch, ids = built.batch, built.input_ids
        layout.verify_rows, layout.sample_rows = built.extras[:2]
        prompt.placed(built.extras[2:])
        if drafting:
            rows = (layout.verify_rows[:, None] + self.verify_offsets[:width]).flatten()
            drafts = proposal.tokens if proposal.trees is None else proposal.tokens[:, 1:]   # a tree's node 0 is the root
            ids[rows.view(len(drafting), width)[:, 1:].flatten()] = drafts.flatten()
            if device_depths:
                batch.positions.index_add_(0, rows, proposal.depths.flatten())
                batch.positions.clamp_(max=self.max_model_len - 1)
        if len(drafting) == len(sched.requests) and width == self.verify_width and "verify" in self.graphs \
                and self.graphs["verify"].fits(batch):
            # A pure verify batch (the steady state of decoding): logits come out of the graph.
            logits, *aux = self.runner.run_graphs(self.graphs["verify"], ids, batch)
            return None, aux, layout, logits
        hidden, aux = self.runner.model(ids, batch, self.runner.kv_caches, aux_layer_ids=self.aux_layer_ids)
        return hidden, aux, layout, None

    # The fixed-shape forwards, as CUDA graphs capture them (eager otherwise).
    def _draft_step(self, ids, hidden, batch):
        normed, prenorm = self.draft(ids, hidden, batch, self.kv)
        return self.draft.compute_logits(normed), prenorm

    def _catchup_forward(self, ids, hidden, batch):
        """Padded catch-up rows -> (logits, pre-norm) of each request's last row, its first proposal."""
        normed, prenorm = self.draft(ids, hidden, batch, self.kv)
        width = self.catchup_rows
        last = slice(width - 1, None, width)
        return self.draft.compute_logits(normed[last]), prenorm[last]

    def _tree_level_forward(self, d: int):
        """Static tree level d: rows are nodes 1..m-1 -> (logits of level d's nodes, every row's pre-norm)."""
        rows, level = max(self.tree.level(d)), self.tree_levels[d]

        def forward(ids, hidden, batch):
            normed, prenorm = self.draft(ids, hidden, batch, self.kv)
            return self.draft.compute_logits(normed.view(-1, rows, normed.shape[-1])[:, level].flatten(0, 1)), prenorm
        return forward

    def _dynamic_level_forward(self, rows: int):
        """Dynamic tree: `rows` expanded nodes per request -> (logits of the newest frontier, pre-norms)."""
        k = self.dynamic.topk

        def forward(ids, hidden, batch):
            normed, prenorm = self.draft(ids, hidden, batch, self.kv)
            return self.draft.compute_logits(normed.view(-1, rows, normed.shape[-1])[:, rows - k:].flatten(0, 1)), prenorm
        return forward

    def _verify_forward(self, ids, _hidden, batch):
        hidden, aux = self.runner.model(ids, batch, self.runner.kv_caches, aux_layer_ids=self.aux_layer_ids)
        return (self.runner.model.compute_logits(hidden), *aux)

    # ---- 4: sampling, verification, commit ---------------------------------------------------------
    def _sampling(self, reqs: list[Request]) -> SamplingTensors:
        """Rows at each request's next token (verify row j and draft j draw the token j places later)."""
        return SamplingTensors.from_params([r.params for r in reqs], self.device, pin=self.pin,
                                           positions=[r.num_tokens for r in reqs])

    def _verify(self, hidden, logits, rows: torch.Tensor, drafting: list[Request], proposal: "_Proposal") -> "_Verified":
        if not drafting:
            return _Verified([], [])
        width = proposal.width
        if logits is None:
            idx = (rows[:, None] + self.verify_offsets[:width]).flatten()
            logits = self.runner.model.compute_logits(hidden[idx])         # [B * width, V], request-major
        greedy = all(r.params.greedy for r in drafting)
        if not greedy:
            st = self._sampling(drafting)
            # A tree node's row draws the token after it: at its depth's offset (a seeded row's noise key).
            offsets = (proposal.trees.depths().tolist() if proposal.trees is not None and st.any_seeded
                       else None)
            probs = verify_probs(logits, st.repeat_rows(width, offsets))
        if proposal.trees is not None:
            out = (tree_greedy_verify(proposal.trees, logits, proposal.tokens) if greedy else
                   tree_rejection_verify(proposal.trees, probs, proposal.tokens, None))
            return _Verified(*out.lists())
        num_draft = torch.full((len(drafting),), self.step_gamma, dtype=torch.long, device=self.device)
        out = (greedy_verify(logits, proposal.tokens, num_draft) if greedy else
               rejection_sample_verify(probs, proposal.tokens, num_draft, proposal.q))
        tokens = out.token_lists()
        return _Verified(tokens, [None] * len(tokens))

    def _commit(self, sched: ScheduledBatch, drafting: list[Request], verified: "_Verified", aux, layout: "_Layout"):
        """Tree: move the accepted path's target KV to consecutive slots. Then keep the fused aux states
        of every newly valid position of a speculative request for its next catch-up."""
        positions = {r.request_id: i for i, r in enumerate(drafting)}
        if drafting and verified.paths[0] is not None:
            self._compact_paths(drafting, verified.paths)
        rows, owners = [], []
        for req, n, start in zip(sched.requests, sched.num_new_tokens, layout.starts):
            i = positions.get(req.request_id)
            if i is None:
                keep = range(start, start + n)
            else:
                path = verified.paths[i] or range(len(verified.tokens[i]))
                keep = [start + node for node in path]
            rows.extend(keep)
            owners.append((req, len(keep)))
        if not rows:
            return
        index = self.staging.ints(rows)
        fused = self.draft.combine_aux([a[index] for a in aux])
        for (req, k), part in zip(owners, fused.split([k for _, k in owners])):
            req.spec_state.draft_pos = req.num_computed_tokens
            req.spec_state.pending = part

    def _compact_paths(self, drafting: list[Request], paths: list[list[int]]) -> None:
        """Move each request's accepted tree path's target KV to consecutive slots after its context."""
        src, dst = [], []
        for req, path in zip(drafting, paths):
            table, base = req.block_ids, req.num_computed_tokens
            for a, b in tree_kv_moves(path):
                src.append(self._slot(table, base + a))
                dst.append(self._slot(table, base + b))
        if not src:                  # every path runs straight down the first branch: nothing moves
            return
        self.runner.move_kv(*self.staging.copy([np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)]))

    # ---- helpers -----------------------------------------------------------------------------------
    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

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


@dataclass
class _Proposal:
    tokens: torch.Tensor                # chain: [B, gamma] draft ids; tree: [B, nodes] node tokens (node 0: root)
    q: torch.Tensor | None = None       # chain, sampled drafts: [B * gamma, V] what each was drawn from
    trees: TreeBatch | None = None      # trees: each request's parents
    depths: np.ndarray | torch.Tensor | None = None   # trees: [B, nodes] node depths (host for a static tree)
    masks: torch.Tensor | None = None   # trees: [B, nodes, nodes] ancestor masks

    @property
    def width(self) -> int:
        """Verify rows per drafting request: the root and its drafts."""
        return self.tokens.shape[1] + (0 if self.trees is not None else 1)


@dataclass
class _Verified:
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


class _Layout:
    """Where each request's rows landed in the packed target forward."""

    def __init__(self):
        self.starts: list[int] = []             # first row of each scheduled request
        self.sample_rows: torch.Tensor | None = None     # [S] plain rows to sample (device)
        self.sample_requests: list[Request] = []
        self.verify_rows: torch.Tensor | None = None     # [D] first verify row of each drafting request (device)
        self.prompt = PromptRows()                      # rows scoring prompt tokens (prompt logprobs)
