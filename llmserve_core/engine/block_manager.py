"""Paged KV block allocator with reference counts and a prefix cache over full blocks.

A full block is named by a chained hash: sha256(parent block's hash + this block's token ids), so equal
hashes mean equal whole prefixes (sha256 makes accidental collisions impossible in practice, unlike
Python's hash()). Freed blocks keep their hash and stay findable until they are reused for other
tokens; the free queue is LRU, so the blocks used longest ago are evicted first.

Every block is in exactly one of three states: used (referenced by a request), cached (unreferenced but
holding a published prefix: evictable, so as good as free for allocation) or free (unreferenced, empty).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from llmserve_core.engine.request import Request


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class NoFreeBlocks(Exception):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 recompute_last_hit_block: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # EAGLE: the draft needs the target's hidden states at the tokens just before new ones, which a
        # cache hit does not produce; recomputing the last hit block gives them (as vLLM does).
        self.recompute_last_hit_block = recompute_last_hit_block
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # With a draft model: whether a published block's draft KV rows are valid (speculative steps
        # computed them) or not (plain steps ran there). Requests hitting a block read it through
        # draft_valid_tokens.
        self.draft_rows_valid: list[bool] = [True] * num_blocks
        self.cached: dict[bytes, int] = {}                    # hash -> block id
        # Unreferenced blocks, cached and free alike, in eviction order (LRU first).
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._num_unreferenced_cached = 0     # of self.free, the blocks that still hold a cached prefix
        self.prefix_queries = 0   # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0      # of those, tokens found

    # ---- accounting -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks holding no cached prefix."""
        return len(self.free) - self._num_unreferenced_cached

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix (evictable)."""
        return self._num_unreferenced_cached

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self.free)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------------
    def reads_cache(self, req: Request) -> bool:
        """Whether a request may start from cached blocks: not one still collecting prompt logprobs, whose
        every prompt position must go through the head."""
        return self.enable_prefix_caching and req.prompt_logprobs is None

    def admit(self, req: Request) -> int:
        """Attach the longest cached prefix of a newly scheduled request; return the tokens it covers.

        The last prompt token is always recomputed: its logits are needed to sample.
        """
        assert not req.block_ids
        if not self.reads_cache(req):
            return 0
        tokens = req.token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        parent = b""
        hits: list[int] = []
        hashes: list[bytes] = []
        for b in range(max_blocks):
            h = hash_block(parent, tokens[b * self.block_size:(b + 1) * self.block_size])
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        if self.recompute_last_hit_block and hits:
            hits.pop()
            hashes.pop()
        for block in hits:
            self._ref(block)
        req.block_ids = hits
        req.block_hashes = hashes
        return len(hits) * self.block_size

    def count_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += min(num_hit_tokens, num_prompt_tokens)

    def can_allocate(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(req.block_ids) <= len(self.free)

    def allocate(self, req: Request, num_tokens: int) -> None:
        """Grow the request's block table to hold num_tokens tokens."""
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need > len(self.free):
            raise NoFreeBlocks
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:                       # evict: this block's old content is gone
                if self.cached.get(old) == block:
                    del self.cached[old]
                self.block_hash[block] = None
                self._num_unreferenced_cached -= 1
            self.ref_counts[block] = 1
            req.block_ids.append(block)

    def cache_full_blocks(self, req: Request, limit: int | None = None, draft_valid_until: int | None = None) -> None:
        """Publish every block of the request that is now full of computed tokens (and below `limit`),
        flagging those past `draft_valid_until` as holding no valid draft rows."""
        if not self.enable_prefix_caching:
            return
        # Blocks past the block table belong to a preempted or finished request: nothing to publish.
        # Only tokens whose ids are known count (async scheduling may have run ahead of them).
        known = min(req.num_computed_tokens, req.num_tokens - req.num_pending)
        if limit is not None:
            known = min(known, limit)
        num_full = min(known // self.block_size, len(req.block_ids))
        tokens = req.token_ids
        for b in range(len(req.block_hashes), num_full):
            parent = req.block_hashes[-1] if req.block_hashes else b""
            h = hash_block(parent, tokens[b * self.block_size:(b + 1) * self.block_size])
            req.block_hashes.append(h)
            block = req.block_ids[b]
            valid = draft_valid_until is None or (b + 1) * self.block_size <= draft_valid_until
            twin = self.cached.get(h)                 # a twin block may already hold the same prefix
            if twin is None or (valid and not self.draft_rows_valid[twin]):
                self.cached[h] = block
                self.block_hash[block] = h
                self.draft_rows_valid[block] = valid

    def draft_valid_tokens(self, req: Request, num_tokens: int) -> int:
        """Of the request's first num_tokens (cache hits), how many lead with valid draft rows."""
        blocks = req.block_ids[:num_tokens // self.block_size]
        valid = next((i for i, b in enumerate(blocks) if not self.draft_rows_valid[b]), len(blocks))
        return min(valid * self.block_size, num_tokens)

    def release(self, req: Request) -> None:
        """Drop the request's references. Tail blocks go to the free queue first, so they are evicted
        before the shared prefix blocks that other requests are more likely to hit again."""
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # uncached: reuse it first
                else:
                    self.free[block] = None
                    self._num_unreferenced_cached += 1
        req.block_ids = []
        req.block_hashes = []

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
            if self.block_hash[block] is not None:
                self._num_unreferenced_cached -= 1
        self.ref_counts[block] += 1

    def check_invariants(self) -> None:
        """Every block is either referenced or in the free queue, never both; cache entries are consistent."""
        for block in range(self.num_blocks):
            in_free = block in self.free
            assert (self.ref_counts[block] == 0) == in_free, f"block {block}: ref {self.ref_counts[block]}, free {in_free}"
        for h, block in self.cached.items():
            assert self.block_hash[block] == h
        cached_free = sum(1 for block in self.free if self.block_hash[block] is not None)
        assert cached_free == self._num_unreferenced_cached, (cached_free, self._num_unreferenced_cached)
        assert self.num_free_blocks + self.num_cached_blocks + self.num_used_blocks == self.num_blocks
