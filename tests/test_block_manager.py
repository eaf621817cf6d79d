"""Block allocator and prefix cache: reference counts, chained hashes, LRU eviction, no leaks."""
import random

from hypothesis import given, settings, strategies as st

from llmserve_core.engine.block_manager import BlockManager, NoFreeBlocks, hash_block
from llmserve_core.engine.request import Request
from llmserve_proto import SamplingParams

import pytest


def make_req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), frozenset(), 10_000)


def run_prefill(bm, req):
    """What the scheduler and engine do for a whole-prompt prefill."""
    req.num_computed_tokens = bm.admit(req)
    bm.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def test_hash_chains_whole_prefix():
    a = hash_block(b"", [1, 2, 3, 4])
    assert hash_block(b"", [1, 2, 3, 4]) == a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(b"", [9, 2, 3, 4]), [5, 6, 7, 8])


def test_prefix_hit_shares_blocks_and_keeps_last_token():
    bm = BlockManager(16, 4)
    a = make_req("a", range(10))               # 2 full blocks + 2 tokens
    run_prefill(bm, a)
    b = make_req("b", list(range(8)) + [99, 98, 97])
    hit = bm.admit(b)
    assert hit == 8 and b.block_ids == a.block_ids[:2]
    assert bm.ref_counts[a.block_ids[0]] == 2
    # A prompt that is exactly two full blocks still recomputes its last token: only one block hits.
    c = make_req("c", range(8))
    assert bm.admit(c) == 4


def test_draft_row_flags_follow_published_blocks_and_valid_twins_replace_flagged_ones():
    bm = BlockManager(16, 4)
    a = make_req("a", range(13))                       # 3 full blocks
    a.num_computed_tokens = bm.admit(a)
    bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a, draft_valid_until=5)       # draft rows valid below 5: block 0 only
    assert [bm.draft_rows_valid[b] for b in a.block_ids[:3]] == [True, False, False]
    hit = make_req("hit", range(13))
    assert bm.admit(hit) == 12
    assert bm.draft_valid_tokens(hit, 12) == 4
    bm.release(hit)
    # A twin computing the same prefix with valid draft rows takes over the cache entries it improves.
    twin = make_req("twin", range(13))
    bm.allocate(twin, twin.num_tokens)
    twin.num_computed_tokens = twin.num_tokens
    bm.cache_full_blocks(twin, draft_valid_until=13)
    assert bm.cached[twin.block_hashes[0]] == a.block_ids[0]        # already valid: kept
    assert bm.cached[twin.block_hashes[1]] == twin.block_ids[1]     # flagged: replaced
    again = make_req("again", range(13))
    assert bm.admit(again) == 12 and bm.draft_valid_tokens(again, 12) == 12
    for r in (a, twin, again):
        bm.release(r)
    bm.check_invariants()
    # Reusing the replaced block for other tokens must not drop the entry that now names its twin.
    while bm.num_free_blocks + bm.num_cached_blocks:      # every unreferenced block, evicting the cached
        bm.allocate(make_req("x", [1]), 1)
    assert bm.num_cached_blocks == 0 and all(bm.ref_counts)


def test_release_keeps_cache_until_evicted_lru():
    bm = BlockManager(4, 2)
    a = make_req("a", [1, 2, 3, 4, 5])
    run_prefill(bm, a)
    bm.release(a)
    bm.check_invariants()
    # Two blocks hold the cached prefix (evictable), two are empty; none is used.
    assert (bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks) == (2, 2, 0)
    again = make_req("a2", [1, 2, 3, 4, 5])
    assert bm.admit(again) == 4           # both full blocks still cached
    assert (bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks) == (2, 0, 2)
    bm.release(again)
    other = make_req("o", [7, 7, 7, 7, 7, 7, 7])
    other.num_computed_tokens = bm.admit(other)
    bm.allocate(other, 7)                 # needs all 4 blocks: evicts both cached ones
    assert (bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks) == (0, 0, 4)
    assert bm.admit(make_req("x", [1, 2, 3, 4, 5])) == 0
    bm.check_invariants()


def test_uncached_blocks_reused_before_cached():
    bm = BlockManager(4, 2)
    a = make_req("a", [1, 2, 3])           # one full cached block, one partial
    run_prefill(bm, a)
    partial = a.block_ids[1]
    bm.release(a)
    b = make_req("b", [9])
    bm.allocate(b, 1)
    assert b.block_ids == [partial]       # the cached block survives
    assert bm.num_cached_blocks == 1


def test_allocate_raises_when_full():
    bm = BlockManager(2, 4)
    r = make_req("r", range(9))
    with pytest.raises(NoFreeBlocks):
        bm.allocate(r, 9)
    assert r.block_ids == [] and bm.num_free_blocks == 2


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.booleans(), st.sampled_from([1, 2, 4]))
def test_random_workload_never_leaks(seed, caching, block_size):
    rnd = random.Random(seed)
    bm = BlockManager(24, block_size, enable_prefix_caching=caching)
    live = []
    prefixes = [[rnd.randrange(50) for _ in range(rnd.randrange(1, 12))] for _ in range(3)]
    for step in range(60):
        op = rnd.random()
        if op < 0.5:
            tokens = rnd.choice(prefixes) + [rnd.randrange(50) for _ in range(rnd.randrange(1, 6))]
            req = make_req(f"r{step}", tokens)
            req.num_computed_tokens = bm.admit(req)
            if bm.can_allocate(req, req.num_tokens):
                bm.allocate(req, req.num_tokens)
                req.num_computed_tokens = req.num_tokens
                bm.cache_full_blocks(req)
                live.append(req)
            else:
                bm.release(req)
        elif op < 0.8 and live:
            req = live[rnd.randrange(len(live))]
            req.token_ids.append(rnd.randrange(50))       # one decode step
            if bm.can_allocate(req, req.num_tokens):
                bm.allocate(req, req.num_tokens)
                req.num_computed_tokens = req.num_tokens
                bm.cache_full_blocks(req)
            else:
                bm.release(req)
                live.remove(req)
        elif live:
            bm.release(live.pop(rnd.randrange(len(live))))
        bm.check_invariants()
        held = sum(len(r.block_ids) for r in live)
        assert held >= bm.num_used_blocks   # shared blocks are counted once in the pool
    for req in live:
        bm.release(req)
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks + bm.num_cached_blocks == bm.num_blocks
    assert bm.num_cached_blocks == (len(bm.cached) if caching else 0)
    assert all(c == 0 for c in bm.ref_counts)
