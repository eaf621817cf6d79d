"""Iteration-level scheduler: continuous batching with decode-first chunked prefill and recompute preemption.

Each step gets a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):
1. running requests that decode take one token each, first, so prefills never stall generation;
2. running requests still mid-prefill take the next chunk of what remains;
3. waiting requests are admitted while budget, sequence slots and KV blocks last: round-robin across
   clients, in arrival order within a client (waiting_queue.py); one whose grammar is still compiling, or
   whose prompt's first block a running request is about to publish to the prefix cache, lets the others
   pass for now.
When a running request needs a block and none is free, the newest running request is preempted:
its blocks are released (full ones stay in the prefix cache) and it goes back to the front of the
queue to be recomputed later. A request is only admitted if it fits in the whole pool, so the oldest
request can always progress: no deadlock, no lost request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmserve_core.engine.block_manager import BlockManager
from llmserve_core.engine.request import Request, RequestStatus
from llmserve_core.engine.waiting_queue import WaitingQueue


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, lookahead_tokens: int = 0):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        # Extra KV slots a drafting request needs per step (speculative draft tokens to verify).
        self.lookahead_tokens = lookahead_tokens
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # First prompt block -> the running request computing it (not yet in the prefix cache).
        self._computing_first_block: dict[tuple[int, ...], Request] = {}

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()

        # Decodes first, then in-flight prefill chunks, both in arrival order.
        for want_prefill in (False, True):
            i = 0
            while i < len(self.running) and budget > 0:
                req = self.running[i]
                i += 1
                if req.is_prefilling != want_prefill or req.request_id in scheduled or req.at_limit:
                    continue
                num_new = self._num_new_tokens(req, budget)
                if num_new == 0:
                    continue
                # Victims are always newer, i.e. later in the list, so index i stays valid.
                if not self._reserve(req, num_new, out):
                    continue
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                scheduled.add(req.request_id)
                budget = self.max_num_batched_tokens - out.total_tokens  # a victim may have returned budget

        # Admit waiting requests, in admission order among those that may start now (see _may_start). The
        # walk goes on past the requests it passes over and restarts only after an admission (which changes
        # the order), so thousands waiting on their grammars cost one look each, not one walk each.
        skipped: set[str] = set()
        candidates = self.waiting.admission_order(skipped)
        while budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = next(candidates, None)
            if req is None:
                break
            if not req.ready:                   # before admit(): hashing its prompt would be wasted
                skipped.add(req.request_id)
                continue
            if not req.block_ids:
                req.num_computed_tokens = self.blocks.admit(req)
            if not self._may_start(req):
                self.blocks.release(req)
                req.num_computed_tokens = 0
                skipped.add(req.request_id)
                continue
            num_new = self._num_new_tokens(req, budget)
            if num_new == 0 or not self.blocks.can_allocate(req, req.num_computed_tokens + num_new):
                # Keep its cached-prefix references only while it is at the head of the queue.
                self.blocks.release(req)
                req.num_computed_tokens = 0
                break
            self.blocks.allocate(req, req.num_computed_tokens + num_new)
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
                self.blocks.count_prefix_lookup(req.num_prompt_tokens, req.num_computed_tokens)
            self.waiting.pop(req)
            candidates = self.waiting.admission_order(skipped)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._note_first_block(req)
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return out

    def _may_start(self, req: Request) -> bool:
        """A request (whose grammar, if any, is compiled) waits, letting others behind it pass, while a
        running request with the same first prompt block has not published that block yet: identical
        prompts (n > 1 copies, retries) then share the prompt's KV through the prefix cache instead of each
        computing it."""
        if not self.blocks.reads_cache(req) or req.num_computed_tokens > 0:
            return True
        key = self._first_block(req)
        owner = self._computing_first_block.get(key) if key is not None else None
        if owner is None or owner is req:
            return True
        if owner.status != RequestStatus.RUNNING or owner.block_hashes:
            del self._computing_first_block[key]    # published, finished or preempted: no longer worth waiting for
            return True
        return False

    def _first_block(self, req: Request) -> tuple[int, ...] | None:
        bs = self.blocks.block_size
        return tuple(req.prompt_token_ids[:bs]) if req.num_prompt_tokens > bs else None

    def _note_first_block(self, req: Request) -> None:
        if self.blocks.enable_prefix_caching and not req.block_hashes and req.num_preemptions == 0:
            key = self._first_block(req)
            if key is not None:
                self._computing_first_block.setdefault(key, req)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.chunked_prefill else 0

    def _reserve(self, req: Request, num_new: int, out: ScheduledBatch) -> bool:
        """Make room for num_new tokens (plus lookahead when decoding), preempting newer requests."""
        need = req.num_computed_tokens + num_new
        if not req.is_prefilling and req.speculative:
            need += self.lookahead_tokens
        while not self.blocks.can_allocate(req, need):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        self.blocks.allocate(req, need)
        return True

    def _preempt(self, req: Request, out: ScheduledBatch) -> None:
        if req in out.requests:  # already given work this step: undo it
            k = out.requests.index(req)
            out.requests.pop(k)
            out.num_new_tokens.pop(k)
        self.running.remove(req)
        self.blocks.release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_preempted(req)
        out.preempted.append(req)

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request from the queues and free its blocks (and its place in the
        grammar compile queue)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.blocks.release(req)
        if req.grammar is not None:
            req.grammar.release()
        req.status = RequestStatus.FINISHED
        key = self._first_block(req)
        if key is not None and self._computing_first_block.get(key) is req:
            del self._computing_first_block[key]
