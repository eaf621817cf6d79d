"""EAGLE-3 proposals: a one-layer draft head (models/eagle3.py) reading the target's aux hidden states.

A drafting step's proposals, before the shared verify (verifier.py):
  1. draft catch-up: one batched draft forward over, for each request of the batch, the positions whose
     target aux states are known but whose draft rows are not computed yet (the last step's accepted
     tokens, or the last prefill chunk). A decoding request's last row proposes d1;
  2. the drafts after d1, by the shape the config asks for: a chain (eagle_chain.py), a static tree
     (eagle_static_tree.py) or a dynamic tree (eagle_dynamic_tree.py);
and after the verify, the aux states of the newly valid positions wait in the request's SpecState
(state.py) for step 1 of its next step.

Alignment: the draft row at position p reads token p + 1 and the target's aux state at p, so it
proposes token p + 2. The draft KV is a one-layer pool with the target's num_blocks and block_size,
addressed through the target's block tables, so allocation, preemption and the prefix cache cover it
too. KV written at rejected positions (target or draft) lies beyond num_computed_tokens and is simply
overwritten by a later step. The algorithms (proposal, verification, trees) live in speculative/.

The steady step (every request drafting at full depth, catching up on at most the tokens its last step
emitted) runs as one graph: the catch-up padded to a fixed row count, the drafts and the verify, with
the later batches derived on the device from the catch-up's (continued_batch).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from llmserve_core.config import EngineConfig
from llmserve_core.engine.block_manager import BlockManager
from llmserve_core.engine.model_runner import ModelRunner
from llmserve_core.engine.request import Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.engine.spec.eagle_chain import ChainDrafter
from llmserve_core.engine.spec.eagle_dynamic_tree import DynamicTreeDrafter
from llmserve_core.engine.spec.eagle_static_tree import StaticTreeDrafter
from llmserve_core.engine.spec.proposer import FusedStep, Proposal, Proposer, SpecContext, Verified
from llmserve_core.engine.spec.state import SpecState
from llmserve_core.engine.step_graphs import StepGraphs
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.models.eagle3_loader import load_eagle3

log = logging.getLogger("llmserve.eagle")

DRAFTERS = {"chain": ChainDrafter, "static": StaticTreeDrafter, "dynamic": DynamicTreeDrafter}


def load_draft(config: EngineConfig, runner: ModelRunner, max_positions: int):
    """The draft head, sharing the target's embedding (and head, if it has none of its own)."""
    embed, lm_head = runner.model.vocab_weights()
    return load_eagle3(config.speculative_model, runner.attn_backend, runner.dtype, runner.device,
                       target_embed=embed, target_lm_head=lm_head, load_format=config.load_format,
                       seed=config.seed, max_positions=max_positions)


class EagleProposer(Proposer):
    def __init__(self, config: EngineConfig, runner: ModelRunner, draft):
        """`draft`: the loaded head (load_draft), loaded before the runner sizes its KV pool."""
        super().__init__()
        shape = config.draft_shape()
        target, dcfg = runner.model_config, draft.cfg
        if dcfg.vocab_size != target.vocab_size or dcfg.target_hidden_size != target.hidden_size:
            raise ValueError(f"speculative_model: the draft expects vocab {dcfg.vocab_size} and target hidden size "
                             f"{dcfg.target_hidden_size}, the target has {target.vocab_size} and {target.hidden_size}")
        if shape.dynamic is not None and shape.dynamic.topk > dcfg.draft_vocab_size:
            raise ValueError(f"speculative_eagle_topk: {shape.dynamic.topk} exceeds the draft's vocabulary "
                             f"({dcfg.draft_vocab_size} tokens)")
        self.name = config.speculative_model
        self.draft = draft
        self.depth = shape.depth
        self.aux_layer_ids = dcfg.resolve_aux_layer_ids(target.num_hidden_layers)
        # Tree candidates are the draft's deterministic top-k, which rejection sampling treats as one-hot q.
        self.sample_drafts = config.speculative_accept_mode == "sample" and shape.kind == "chain"
        self.drafter = DRAFTERS[shape.kind](self, shape, runner.device)
        # A decoding request catches up on at most the tokens its last step emitted: its accepted drafts
        # plus one. The catch-up graph pads every request to that many rows.
        self.catchup_rows = 1 + self.drafter.depth
        # Greedy chain drafts and trees need nothing from the host between the catch-up and the verify, so
        # a whole steady step (catch-up, draft forwards, verify) can be one graph; sampled chain drafts draw
        # with per-request noise and keep the step by step path. So does tensor parallelism: that
        # graph's verify reads drafts only rank 0's draft computes, so no worker could replay it (and meet
        # its all-reduces); the verify's own graph, its drafts sent in the step broadcast, replays on all.
        self.fused = not self.sample_drafts and runner.tp is None
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        rows = max(shape.verify_width, self.catchup_rows, shape.lookahead + 1)
        self.offsets = torch.arange(rows, device=runner.device)       # row offsets within a request's rows

    def kv_bytes_per_block(self, runner: ModelRunner) -> int:
        """One block of the draft's one-layer KV pool."""
        cfg = self.draft.cfg
        return 2 * runner.block_size * cfg.num_key_value_heads * cfg.head_dim * runner.dtype.itemsize

    def describe(self) -> str:
        return f"EAGLE-3 draft {self.name} (aux layers {list(self.aux_layer_ids)})"

    def setup(self, ctx: SpecContext) -> None:
        super().setup(ctx)
        runner, dcfg = ctx.runner, self.draft.cfg
        shape = (runner.num_blocks, runner.block_size, dcfg.num_key_value_heads, dcfg.head_dim)
        self.kv = (torch.zeros(shape, dtype=runner.dtype, device=ctx.device),
                   torch.zeros(shape, dtype=runner.dtype, device=ctx.device))
        if runner.use_graphs:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """The draft's fixed-shape forwards: the catch-up, the drafter's (a chain's draft step, each tree
        level's), and the steady step's. On the CPU (tests) they run eagerly through the same buffers
        and padding."""
        draft_rows = dict(hidden_size=self.draft.cfg.hidden_size, capture=self.ctx.device.type == "cuda",
                          **self.ctx.graph_args())
        self.graphs["catch-up"] = StepGraphs("catch-up", self.catchup_forward, self.catchup_rows, **draft_rows)
        self.drafter.capture(self.graphs, draft_rows)
        if self.fused:
            # It only saves host work: should its capture fail on some device, drafting steps run forward
            # by forward.
            try:
                self.graphs["fused step"] = StepGraphs("fused step", self.drafter.fused_forward, self.catchup_rows,
                                                       **draft_rows)
            except RuntimeError as e:
                log.error("EAGLE-3: the fused step's CUDA graph failed to capture (%s); drafting steps run "
                          "forward by forward", str(e).splitlines()[0] if str(e) else type(e).__name__)
                self.fused = False

    def forward(self, name: str, fn, ids: torch.Tensor, hidden: torch.Tensor | None, batch: ForwardBatch):
        """Through the named graph where the batch has its shape, else eagerly."""
        graphs = self.graphs.get(name)
        if graphs is not None and graphs.fits(batch):
            return graphs.run(ids, hidden, batch)
        return fn(ids, hidden, batch)

    # ---- per request -----------------------------------------------------------------------------
    def on_scheduled(self, sched: ScheduledBatch, block_manager: BlockManager) -> None:
        """Preempted requests lost their KV, draft rows too; new and readmitted ones start at their cache
        hit, whose draft rows are valid as far as the cached blocks say."""
        for req in sched.preempted:
            req.spec_state = None
        for req in sched.requests:
            if req.spec_state is None:
                req.spec_state = SpecState()
                req.spec_state.start(req.num_computed_tokens,
                                     block_manager.draft_valid_tokens(req, req.num_computed_tokens))

    def publish(self, req: Request, block_manager: BlockManager) -> None:
        """Full blocks go to the prefix cache flagged with whether their draft rows are valid (SpecState)."""
        state = req.spec_state
        if state is None:                    # preempted in this step's scheduling: nothing to publish
            return
        state.sync(req.num_computed_tokens)  # after a plain step: the positions it ran have no draft rows
        limit, valid = state.publish_limits(req.num_computed_tokens)
        block_manager.cache_full_blocks(req, limit=limit, draft_valid_until=valid)

    # ---- a drafting step ---------------------------------------------------------------------------
    def drafting(self, sched: ScheduledBatch) -> list[Request]:
        """A decoding request has pending rows (its last step's tokens) unless plain steps ran since: then
        this step only computes its aux states, and it drafts from the next one on."""
        for req in sched.requests:
            req.spec_state.sync(req.num_computed_tokens)
        return [r for r in sched.requests if r.speculative and not r.is_prefilling and r.spec_state.pending is not None]

    def propose(self, sched: ScheduledBatch, drafting: list[Request], depth: int) -> Proposal:
        # Catch-up: draft rows for positions draft_pos .. num_computed - 1, reading the tokens one later.
        pending = [r for r in sched.requests if r.spec_state.pending is not None]
        if not pending:
            return Proposal.empty(self.ctx.device)
        if self._catchup_pads(self.graphs.get("catch-up"), pending, drafting):
            logits, h = self._catchup_padded(self.graphs["catch-up"], drafting)
        else:
            logits, h = self._catchup_ragged(pending, drafting)
        if not drafting:
            return Proposal.empty(self.ctx.device)
        return self.drafter.draft(drafting, logits, h, depth)

    def _catchup_ragged(self, pending: list[Request], drafting: list[Request]):
        """One draft forward over every pending row; (logits, pre-norm) of each drafting request's last row
        (its first proposal), or (None, None) when nothing drafts."""
        b = self.ctx.builder
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
        builder = self.ctx.builder
        builder.add_uniform([r.block_ids for r in drafting], np.maximum(at, 0), np.where(live, at, -1), ends,
                            np.asarray(ids, dtype=np.int64).reshape(n, width))
        dest = np.flatnonzero(live.reshape(-1))
        n = graphs.load(builder.finish_host(), dest)
        rows = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        graphs.hidden.index_copy_(0, graphs.extra[:len(dest)], rows)
        return graphs.replay(n)

    def keep(self, sched: ScheduledBatch, drafting: list[Request], verified: Verified, aux: list[torch.Tensor],
             starts: list[int]) -> None:
        """Keep the fused aux states of every newly valid position of each scheduled request (a drafting
        one's accepted rows) for its next catch-up."""
        positions = {r.request_id: i for i, r in enumerate(drafting)}
        rows, owners = [], []
        for req, n, start in zip(sched.requests, sched.num_new_tokens, starts):
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
        index = self.ctx.staging.ints(rows)
        fused = self.draft.combine_aux([a[index] for a in aux])
        for (req, k), part in zip(owners, fused.split([k for _, k in owners])):
            req.spec_state.draft_pos = req.num_computed_tokens
            req.spec_state.pending = part

    # ---- the steady step in one graph ------------------------------------------------------------------
    def fused_fits(self, sched: ScheduledBatch, drafting: list[Request], depth: int) -> bool:
        """A pure drafting batch at full depth whose catch-up pads: the fused graph's shape."""
        if not (self.fused and drafting and len(drafting) == len(sched.requests) and depth == self.depth):
            return False
        pending = [r for r in sched.requests if r.spec_state.pending is not None]
        return self._catchup_pads(self.graphs.get("fused step"), pending, drafting)

    def run_fused(self, drafting: list[Request]) -> FusedStep:
        """Catch-up, draft forwards and verify from one host-built batch and one replay."""
        return self.drafter.fused_step(self._catchup_padded(self.graphs["fused step"], drafting))

    def keep_fused(self, drafting: list[Request], verified: Verified, kept: torch.Tensor) -> None:
        """keep() for the fused step, whose graph already fused the aux of every verify row (`kept`): a
        chain keeps each request's first len(tokens) rows (copied out: the graph's next replay rewrites its
        outputs), a tree the rows of its accepted path."""
        width = self.ctx.shape.verify_width
        if verified.paths[0] is None:
            kept = kept.clone()
            parts = [kept[i * width:i * width + len(tokens)] for i, tokens in enumerate(verified.tokens)]
        else:
            rows = [i * width + node for i, path in enumerate(verified.paths) for node in path]
            parts = kept[self.ctx.staging.ints(rows)].split([len(path) for path in verified.paths])
        for req, part in zip(drafting, parts):
            req.spec_state.draft_pos = req.num_computed_tokens
            req.spec_state.pending = part

    # ---- the draft's forwards, as graphs capture them (eager otherwise) -----------------------------------
    def draft_step(self, ids, hidden, batch):
        normed, prenorm = self.draft(ids, hidden, batch, self.kv)
        return self.draft.compute_logits(normed), prenorm

    def catchup_forward(self, ids, hidden, batch):
        """Padded catch-up rows -> (logits, pre-norm) of each request's last row, its first proposal."""
        normed, prenorm = self.draft(ids, hidden, batch, self.kv)
        width = self.catchup_rows
        last = slice(width - 1, None, width)
        return self.draft.compute_logits(normed[last]), prenorm[last]

    def fused_catchup(self, ids, hidden, batch):
        """The fused step's first forward: (proposal logits, pre-norm of each request's last catch-up row,
        each request's context length [B], whether it is a live request rather than graph padding [B])."""
        logits, h = self.catchup_forward(ids, hidden, batch)
        live = batch.slot_mapping.view(batch.num_seqs, self.catchup_rows)[:, -1] >= 0     # padding writes no KV
        return logits, h, batch.seq_lens.long(), live

    def continued_batch(self, batch: ForwardBatch, first: torch.Tensor, rows: int, live: torch.Tensor,
                        rope: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                        count_live: bool = False) -> ForwardBatch:
        """`rows` rows per sequence at KV positions first .. first + rows - 1, in `batch`'s blocks, causal
        or under `tree_mask` ([B * rows, rows]), at rotary positions `rope` ([B, rows]; default: the KV
        positions); sequences not `live` write nothing. Built on the device (no host copy), as
        BatchBuilder.add / add_rows would. count_live (the target's verify): the batch carries its live
        rows' count (the padding sequences come last), for the MoE router."""
        block_size = self.ctx.runner.block_size
        kv = first[:, None] + self.offsets[:rows]                                          # [B, rows]
        tables = batch.block_tables
        blocks = tables.gather(1, (kv // block_size).clamp(max=tables.shape[1] - 1)).long()
        slots = torch.where(live[:, None], blocks * block_size + kv % block_size, -1)
        n = first.shape[0]
        rope = kv if rope is None else rope
        return ForwardBatch(
            positions=rope.clamp(max=self.ctx.builder.max_position - 1).flatten(), slot_mapping=slots.flatten(),
            query_start_loc=torch.arange(0, (n + 1) * rows, rows, dtype=torch.int32, device=first.device),
            seq_lens=(first + rows).int(), block_tables=tables, max_query_len=rows, max_seq_len=batch.max_seq_len,
            tree_mask=tree_mask, uniform_query_len=rows,
            live_rows=(live.sum(dtype=torch.int32) * rows).view(1) if count_live else None)
