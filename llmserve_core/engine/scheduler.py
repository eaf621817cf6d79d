"""Iteration-level scheduler: continuous batching with decode-first chunked prefill, recompute preemption, and
fair shares between clients.

Each step gets a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):
1. running requests that decode take one token each, first, so prefills never stall generation;
2. running requests still mid-prefill take the next chunk of what remains, each client within a max-min
   fair share of the budget left (counting the first prompt of each client that could start now), so one
   client's long prompts cannot hold back another's;
3. waiting requests are admitted while budget, sequence slots and KV blocks last: the client running the
   fewest first, in arrival order within a client (waiting_queue.py); one whose grammar is still compiling,
   or whose prompt's first block a running request is about to publish to the prefix cache, lets the others
   pass for now.
When a running request needs a block and none is free, a newer running request is preempted (the newest
of the client running the most among them): its blocks are released (full ones stay in the prefix cache)
and it goes back to the front of its client's queue to be recomputed later. A request is only admitted if it fits in the whole pool, so the
oldest request can always progress: no deadlock, no lost request.
Fairness preemption: slots free up only as requests end, so a client whose requests were all admitted
together can hold every slot for a whole request's length. When the head of a client's queue has waited
fairness_preempt_steps steps for a slot (or blocks) while another client runs at least two more requests,
the newest request of the client running the most is preempted for it: shares converge to max-min fair
within that bound, and the victim, kept in the prefix cache, mostly resumes from cached blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

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


def fair_shares(demands: dict, capacity: int) -> dict:
    """Max-min fair split of `capacity` between demands: the smallest are met whole, the rest share equally
    what is left (the largest takes the remainder of the integer division)."""
    shares, left, n = {}, capacity, len(demands)
    for key, want in sorted(demands.items(), key=lambda kv: kv[1]):
        shares[key] = give = min(want, left // n if n > 1 else left)
        left -= give
        n -= 1
    return shares


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, lookahead_tokens: int = 0, fairness_preempt_steps: int = 0):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        # Extra KV slots a drafting request needs per step (speculative draft tokens to verify).
        self.lookahead_tokens = lookahead_tokens
        self.fairness_preempt_steps = fairness_preempt_steps     # 0: never preempt for fairness
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_steps = 0                      # schedule() calls: the clock of queue waits
        self.num_preemptions = 0
        self.num_fairness_preemptions = 0
        # First prompt block -> the running request computing it (not yet in the prefix cache).
        self._computing_first_block: dict[tuple[int, ...], Request] = {}

    def add(self, req: Request) -> None:
        req.queued_step = self.num_steps
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self.num_steps += 1
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()

        # Decodes first, then in-flight prefill chunks, both in arrival order.
        for want_prefill in (False, True):
            shares = self._prefill_shares(budget, scheduled) if want_prefill else None
            i = 0
            while i < len(self.running) and budget > 0:
                req = self.running[i]
                i += 1
                if req.is_prefilling != want_prefill or req.request_id in scheduled or req.at_limit:
                    continue
                num_new = self._num_new_tokens(req, budget if shares is None else min(budget, shares[req.client]))
                if num_new == 0:
                    continue
                # Victims are always newer, i.e. later in the list, so index i stays valid.
                if not self._reserve(req, num_new, out):
                    continue
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                scheduled.add(req.request_id)
                if shares is not None:
                    shares[req.client] -= num_new
                budget = self.max_num_batched_tokens - out.total_tokens  # a victim may have returned budget
        self._admit(out, budget)
        return out

    def _admit(self, out: ScheduledBatch, budget: int) -> None:
        """Admit waiting requests, in admission order among those that may start now (see _may_start). The
        walk goes on past the requests it passes over and restarts only after an admission (which changes
        the order), so thousands waiting on their grammars cost one look each, not one walk each. No
        admission follows a preemption for blocks: the pool is short."""
        skipped: set[str] = {r.request_id for r in out.preempted}    # their tokens may still be in flight
        short_of_blocks = bool(out.preempted)
        candidates = self.waiting.admission_order(skipped)
        while budget > 0 and not short_of_blocks:
            req = next(candidates, None)
            if req is None:
                break
            if not req.ready:                   # before admit(): hashing its prompt would be wasted
                skipped.add(req.request_id)
                continue
            full = len(self.running) >= self.max_num_seqs
            if full and self._victim_for(req) is None:
                break
            if not req.block_ids:
                req.num_computed_tokens = self.blocks.admit(req)
            if not self._may_start(req):
                self._unadmit(req)
                skipped.add(req.request_id)
                continue
            if full:
                self._preempt_for(req, out, skipped)
            num_new = self._num_new_tokens(req, self.max_num_batched_tokens - out.total_tokens)
            while num_new and not self.blocks.can_allocate(req, self._need(req, num_new)):
                num_new = 0
                if self._preempt_for(req, out, skipped):
                    num_new = self._num_new_tokens(req, self.max_num_batched_tokens - out.total_tokens)
            if num_new == 0:
                self._unadmit(req)       # keep its cached-prefix references only while it is admitted
                break
            self.blocks.allocate(req, self._need(req, num_new))
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
            budget = self.max_num_batched_tokens - out.total_tokens

    def _unadmit(self, req: Request) -> None:
        self.blocks.release(req)
        req.num_computed_tokens = 0

    def _victim_for(self, req: Request) -> Request | None:
        """What `req`, the next to start but short of a slot or blocks, may take them from: once it has
        waited fairness_preempt_steps, the newest request of the client running the most, if that client
        runs at least two more than req's (so the shares move one step toward max-min fair, never past it)."""
        if not self.fairness_preempt_steps or self.num_steps - req.queued_step < self.fairness_preempt_steps:
            return None
        holder, most = self.waiting.most_running()
        if most < self.waiting.running(req.client) + 2:
            return None
        return next((r for r in reversed(self.running) if r.client == holder and not r.at_limit), None)

    def _preempt_for(self, req: Request, out: ScheduledBatch, skipped: set[str]) -> bool:
        victim = self._victim_for(req)
        if victim is None:
            return False
        self._preempt(victim, out)
        skipped.add(victim.request_id)          # a step in flight may still bring its last token
        self.num_fairness_preemptions += 1
        return True

    def _prefill_shares(self, budget: int, scheduled: set[str]) -> dict | None:
        """Each client's max-min fair share of the budget for prefill chunks this step; None when one client
        (or none) wants any, or without chunked prefill (a prompt must then fit one step whole). A client that
        could start a request now counts with its head's prompt, so running prefills leave it room."""
        if not self.chunked_prefill:
            return None
        demands: dict = {}
        for req in self.running:
            if req.is_prefilling and req.request_id not in scheduled and not req.at_limit:
                demands[req.client] = demands.get(req.client, 0) + req.num_tokens - req.num_computed_tokens
        free = self.max_num_seqs - len(self.running)
        for client in islice(self.waiting.clients_in_turn(), max(free, 0)):
            head = self.waiting.head(client)
            if head.ready:
                demands[client] = demands.get(client, 0) + head.num_tokens
        if len(demands) < 2:
            return None
        return fair_shares(demands, budget)

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
        need = self._need(req, num_new)
        while not self.blocks.can_allocate(req, need):
            victim = self._newer_victim(req)
            self._preempt(victim, out)
            if victim is req:
                return False
        self.blocks.allocate(req, need)
        return True

    def _newer_victim(self, req: Request) -> Request:
        """Whom req, short of blocks, preempts: a request newer than itself (so the oldest always progresses),
        the newest of the client among those that runs the most (so a client over its share gives up blocks
        before one under it, which fairness has just admitted); req itself when it is the newest."""
        newer = self.running[self.running.index(req) + 1:]
        if not newer:
            return req
        # Ties go to the client of the newest request (the first maximum, newest first): a lone client, or
        # clients at equal shares, lose the newest request as before.
        holder = max(dict.fromkeys(r.client for r in reversed(newer)), key=self.waiting.running)
        return next(r for r in reversed(newer) if r.client == holder)

    def _need(self, req: Request, num_new: int) -> int:
        """KV slots req needs for num_new more tokens, and its drafts' when it decodes: it may draft this step
        (a running request, or one admitted with one token left: a one-token prompt, or all but the last
        cached)."""
        drafts = req.speculative and not req.is_prefilling
        return req.num_computed_tokens + num_new + (self.lookahead_tokens if drafts else 0)

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
        req.queued_step = self.num_steps
        self.num_preemptions += 1
        self.waiting.push_preempted(req)
        out.preempted.append(req)

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request from the queues and free its blocks (and its place in the
        grammar compile queue)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.waiting.stopped(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.blocks.release(req)
        if req.grammar is not None:
            req.grammar.release()
        req.status = RequestStatus.FINISHED
        key = self._first_block(req)
        if key is not None and self._computing_first_block.get(key) is req:
            del self._computing_first_block[key]
