"""Dynamic draft trees and per-request tree batches (speculative/dynamic_tree.py, tree.py, shape.py)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from llmserve_core.speculative.dynamic_tree import DynamicTreeShape, TreeGrowth
from llmserve_core.speculative.shape import draft_shape
from llmserve_core.speculative.tree import TreeBatch, get_tree, tree_greedy_verify, tree_rejection_verify

VOCAB = 12


def path_logprobs(path: tuple[int, ...], seed: int, flat: bool = False) -> torch.Tensor:
    """The fake draft: a fixed distribution over the next token for every path of tokens from the root."""
    if flat:
        return torch.full((VOCAB,), -math.log(VOCAB))
    g = torch.Generator().manual_seed(hash((seed,) + path) % 2**31)
    return torch.log_softmax(torch.randn(VOCAB, generator=g) * 2, -1)


def grow_with_engine_code(shape: DynamicTreeShape, seeds: list[int], flat=False):
    """Drive TreeGrowth as the executor does, answering each draft row from its path."""
    batch = len(seeds)
    growth = TreeGrowth(shape, torch.stack([path_logprobs((), s, flat) for s in seeds]), None)
    while not growth.done:
        tokens, source, mask = growth.draft_rows()
        m = tokens.shape[1]
        rows = []
        for b in range(batch):
            paths = []
            for e in range(m):
                parent = int(source[b, e]) - 1
                assert parent < e, "a row's parent comes earlier"
                # The mask must mark exactly the row's ancestors among the expanded rows.
                want = {e} | ({j for j in range(m) if mask[b, parent, j]} if parent >= 0 else set())
                assert {j for j in range(m) if mask[b, e, j]} == want
                paths.append((paths[parent] if parent >= 0 else ()) + (int(tokens[b, e]),))
            rows.append(torch.stack([path_logprobs(p, seeds[b], flat) for p in paths[m - shape.topk:]]))
        growth.grow(torch.cat(rows))
    return growth.finish(torch.tensor([99] * batch))


def reference_tree(shape: DynamicTreeShape, seed: int) -> set[tuple[int, ...]]:
    """EAGLE-2's selection written directly over token paths: frontier = best k of each level's
    children, tree = best num_draft_tokens - 1 of every candidate by cumulative log-probability."""
    k = shape.topk

    def children(path, score):
        lp = path_logprobs(path, seed)
        top = lp.topk(k)
        return [(path + (int(t),), score + min(float(v), 0.0)) for v, t in zip(top.values, top.indices)]

    pool = children((), 0.0)
    frontier = pool
    for _ in range(shape.num_steps - 1):
        level = [c for p, s in frontier for c in children(p, s)]
        pool += level
        frontier = sorted(level, key=lambda c: -c[1])[:k]
    best = sorted(pool, key=lambda c: -c[1])[:shape.num_draft_tokens - 1]
    return {p for p, _ in best}


def tree_paths(trees: TreeBatch, tokens: torch.Tensor, b: int) -> list[tuple[int, ...]]:
    parents = trees.parents[b].tolist()
    paths = [()]
    for i in range(1, len(parents)):
        assert 0 <= parents[i] < i, "parents come before children and every kept node's parent is kept"
        paths.append(paths[parents[i]] + (int(tokens[b, i]),))
    return paths


@pytest.mark.parametrize("steps,topk,n", [(1, 3, 4), (3, 2, 6), (4, 3, 12), (5, 4, 24), (3, 1, 4), (2, 3, 13)])
def test_growth_matches_the_reference_selection(steps, topk, n):
    shape = DynamicTreeShape(steps, topk, n)
    seeds = [1, 2, 3]
    trees, tokens = grow_with_engine_code(shape, seeds)
    assert tokens.shape == (3, n) and tokens[:, 0].tolist() == [99] * 3
    depths = trees.depths()
    for b, seed in enumerate(seeds):
        paths = tree_paths(trees, tokens, b)
        assert set(paths[1:]) == reference_tree(shape, seed)
        assert len(set(paths)) == n                              # distinct siblings: no path twice
        assert depths[b].tolist() == [len(p) for p in paths]
        assert max(len(p) for p in paths) <= steps
    masks = trees.attention_masks()
    for b in range(3):
        for i in range(n):
            j, anc = i, set()
            while j >= 0:
                anc.add(j)
                j = int(trees.parents[b, j])
            assert {c for c in range(n) if masks[b, i, c]} == anc


def test_ties_keep_parents_first_and_the_tree_connected():
    """A flat draft makes every candidate of a level tie with its siblings and cousins: the kept set
    must still be a connected subtree, numbered parents first."""
    shape = DynamicTreeShape(4, 3, 20)
    trees, tokens = grow_with_engine_code(shape, [5, 6], flat=True)
    for b in range(2):
        paths = tree_paths(trees, tokens, b)
        # Equal scores per level: the tree fills level by level (all 3 + 9 of levels 1-2, then 7 of level 3).
        assert sorted(len(p) for p in paths[1:]) == [1] * 3 + [2] * 9 + [3] * 7


def test_topk1_dynamic_tree_is_the_greedy_chain():
    shape = DynamicTreeShape(4, 1, 5)
    trees, tokens = grow_with_engine_code(shape, [8])
    assert trees.parents[0].tolist() == [-1, 0, 1, 2, 3]
    path = ()
    for i in range(1, 5):
        nxt = int(path_logprobs(path, 8).argmax())
        assert int(tokens[0, i]) == nxt
        path += (nxt,)


def test_static_tree_batch_equals_the_tree():
    tree = get_tree("eagle-small", 3)
    tb = tree.batch(2)
    assert torch.equal(tb.attention_masks()[1], tree.attention_mask())
    assert tb.depths()[0].tolist() == list(tree.depths)
    table = tb.children_table()[0]
    for i, kids in enumerate(tree.children):
        assert [c for c in table[i].tolist() if c >= 0] == list(kids)


def test_verify_with_different_trees_per_request_equals_each_alone():
    torch.manual_seed(2)
    shape = DynamicTreeShape(3, 2, 6)
    trees, tokens = grow_with_engine_code(shape, [11, 12, 13, 14])
    tokens = tokens % VOCAB
    n = shape.num_draft_tokens
    # Targets that often agree with the candidates, so paths of several lengths appear.
    logits = torch.randn(4 * n, VOCAB)
    logits[torch.arange(4 * n), tokens.roll(-1, 1).flatten()] += 3.0
    together = tree_greedy_verify(trees, logits, tokens)
    # Seeded sampled requests: verify_probs keys each node's noise by (seed, position + its depth), so a
    # request's outcome is the same in the batch and alone.
    from llmserve_core.layers.sampler import SamplingTensors
    from llmserve_core.speculative.verify import verify_probs
    from llmserve_proto import SamplingParams

    def seeded_probs(rows, tree_batch, seeds):
        st = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=s) for s in seeds], "cpu",
                                         positions=[30] * len(seeds))
        return verify_probs(rows, st.repeat_rows(n, tree_batch.depths().tolist()))
    sampled = tree_rejection_verify(trees, seeded_probs(logits, trees, range(4)), tokens, None)
    assert len({len(p) for p in together.lists()[1]}) > 1
    for b in range(4):
        one = TreeBatch(trees.parents[b:b + 1], trees.max_depth, trees.max_children)
        alone = tree_greedy_verify(one, logits[b * n:(b + 1) * n], tokens[b:b + 1])
        assert alone.token_lists()[0] == together.token_lists()[b]
        assert alone.lists()[1][0] == together.lists()[1][b]
        again = tree_rejection_verify(one, seeded_probs(logits[b * n:(b + 1) * n], one, [b]), tokens[b:b + 1])
        assert again.token_lists()[0] == sampled.token_lists()[b]


def test_rejection_over_dynamic_trees_is_lossless():
    """Each request has its own tree; the first emitted token must follow the target at the root."""
    torch.manual_seed(7)
    shape = DynamicTreeShape(2, 3, 7)
    trials = 6000
    seeds = [random.Random(1).randrange(10**6) for _ in range(4)]
    trees, tokens = grow_with_engine_code(shape, seeds)
    rep = trials // 4
    parents = trees.parents.repeat_interleave(rep, 0)
    tokens = tokens.repeat_interleave(rep, 0) % VOCAB
    n = shape.num_draft_tokens
    p = torch.softmax(torch.randn(n, VOCAB), -1)
    out = tree_rejection_verify(TreeBatch(parents, trees.max_depth, trees.max_children), p.repeat(len(tokens), 1),
                                tokens)
    counts = torch.bincount(out.token_ids[:, 0], minlength=VOCAB).double()
    expected = p[0].double() * len(tokens)
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = VOCAB - 1
    assert stat < df * (1 - 2 / (9 * df) + 3.5 * math.sqrt(2 / (9 * df))) ** 3


def test_children_table_refuses_more_children_than_its_bound():
    with pytest.raises(ValueError, match="max_children"):
        TreeBatch(torch.tensor([[-1, 0, 0, 0]]), 1, 2).children_table()


def test_shape_resolution_and_errors_name_the_field():
    assert draft_shape(None, None, 1, None, None).kind == "chain"
    assert draft_shape(None, 5, 1, None, None).verify_width == 6
    dyn = draft_shape(None, 4, 3, 16, None)
    assert dyn.kind == "dynamic" and dyn.verify_width == 16 and dyn.lookahead == max(15, 3 * 3 - 1)
    assert draft_shape(2, None, 1, None, "dynamic").dynamic.topk == 1
    assert draft_shape(3, None, 1, None, "eagle-small").verify_width == 11
    assert draft_shape(None, 3, 4, None, None).dynamic.num_draft_tokens == 13
    bad = [
        ((3, 4, 1, None, None), "speculative_num_steps"),          # two names, two values
        ((None, 0, 1, None, None), "speculative_num_steps"),
        ((2**63, None, 1, None, None), "speculative_gamma"),
        ((None, 3, 0, None, None), "speculative_eagle_topk"),
        ((None, 3, 2**64, None, None), "speculative_eagle_topk"),
        ((None, 3, True, None, None), "speculative_eagle_topk"),
        ((None, 3, 2, 1, None), "speculative_num_draft_tokens"),
        ((None, 2, 2, 8, None), "speculative_num_draft_tokens"),   # only 6 candidates grow
        ((None, 3, 2, -2**63, None), "speculative_num_draft_tokens"),
        ((None, 3, 1, 7, None), "speculative_num_draft_tokens"),   # a chain verifies 4
        ((None, 3, 2, None, "eagle-small"), "speculative_eagle_topk"),
        ((None, 3, 1, 5, "eagle-small"), "speculative_num_draft_tokens"),
        ((None, 3, 1, None, "nope"), "speculative_tree"),
        ((None, 3.5, 1, None, None), "speculative_num_steps"),
    ]
    for args, field in bad:
        with pytest.raises(ValueError, match=field):
            draft_shape(*args)
