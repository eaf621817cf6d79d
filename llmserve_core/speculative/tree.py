"""Candidate trees: layout, attention mask, verification and the KV moves that commit a path.

A static tree (CandidateTree) is fixed before serving starts; a dynamic one (dynamic_tree.py) is grown
per request and step. Both reach verification as a TreeBatch: per-request parent arrays. Node 0 is the
root: the last accepted token, whose KV is not cached yet. Every other node is a draft candidate.
Parents come before children, so a request's verify forward carries its nodes as query tokens 0..N-1,
node i at position base + depth[i], and sees its cached prefix plus its own ancestors. Verification
walks down from the root; the accepted path is then moved so that path node k sits at query offset k
(where a chain would have put it) and the other nodes are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve_core.layers.sampler import draw


@dataclass(frozen=True)
class CandidateTree:
    name: str
    parents: tuple[int, ...]          # parents[0] == -1
    ranks: tuple[int, ...]            # rank among the parent's draft top-k; root 0
    depths: tuple[int, ...] = field(init=False)
    children: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1 or len(self.ranks) != len(self.parents):
            raise ValueError("tree: node 0 must be the root (parent -1), one rank per node")
        depths, children = [0], [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"tree: node {i} must come after its parent {p}")
            depths.append(depths[p] + 1)
            children[p].append(i)
        if any(a > b for a, b in zip(depths, depths[1:])):
            raise ValueError("tree: nodes must be numbered level by level")
        for kids in children:
            if sorted(self.ranks[c] for c in kids) != list(range(len(kids))):
                raise ValueError("tree: a node's children must take ranks 0..k-1")
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", tuple(tuple(sorted(c, key=lambda n: self.ranks[n])) for c in children))

    @classmethod
    def from_paths(cls, name: str, paths) -> "CandidateTree":
        """Paths of child ranks from the root, e.g. (0,), (1,), (0, 0): the Medusa/EAGLE 'choices' format."""
        paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        index = {(): 0}
        parents, ranks = [-1], [0]
        for p in paths:
            if not p or p[:-1] not in index:
                raise ValueError(f"tree {name}: path {p} has no parent path")
            index[p] = len(parents)
            parents.append(index[p[:-1]])
            ranks.append(p[-1])
        return cls(name, tuple(parents), tuple(ranks))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def level(self, d: int) -> list[int]:
        return [i for i, x in enumerate(self.depths) if x == d]

    def max_children(self, d: int) -> int:
        """Top-k the draft must produce at the nodes of level d to fill level d + 1."""
        return max((len(self.children[i]) for i in self.level(d)), default=0)

    def attention_mask(self, device=None) -> torch.Tensor:
        """[N, N] bool: node i sees node j iff j is i or one of its ancestors."""
        mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        for i in range(self.num_nodes):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = self.parents[j]
        return mask.to(device)

    def batch(self, batch: int, device=None) -> "TreeBatch":
        """This tree for each of `batch` requests, as verification takes it."""
        parents = torch.tensor(self.parents, dtype=torch.long, device=device).expand(batch, -1)
        return TreeBatch(parents, self.depth, max(1, max(len(c) for c in self.children)), bounded=True)


@dataclass
class TreeBatch:
    """One verify step's candidate trees, N nodes per request (trees may differ between requests).
    Siblings are tried in node order, so number a node's children best first."""
    parents: torch.Tensor       # [B, N] int64: parent node of each node, -1 at node 0; parents[b, i] < i
    max_depth: int              # bound on every node's depth (how far a walk from the root can go)
    max_children: int           # bound on any node's number of children
    # True where the builder guarantees max_children (a static tree, a dynamic tree's top-k growth): the
    # check then costs no device-to-host read in the middle of a step.
    bounded: bool = False

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]

    def children_table(self) -> torch.Tensor:
        """[B, N, max_children] child node ids in node order, padded with -1."""
        par = self.parents
        batch, n = par.shape
        idx = torch.arange(n, device=par.device)
        # A child's slot: how many earlier nodes share its parent.
        rank = ((par[:, :, None] == par[:, None, :]) & (idx[None, None, :] < idx[None, :, None])).sum(-1)
        live = par >= 0
        if not self.bounded and bool((rank >= self.max_children)[live].any()):
            raise ValueError(f"tree: a node has more than max_children = {self.max_children} children")
        # Node 0 (no parent) lands in a scratch row and column, so no index depends on a host read (as
        # nonzero() would).
        k = self.max_children
        table = torch.full((batch, n + 1, k + 1), -1, dtype=torch.long, device=par.device)
        b = torch.arange(batch, device=par.device)[:, None].expand(batch, n)
        table[b, torch.where(live, par, n), torch.where(live, rank.clamp_max(k), k)] = idx.expand(batch, n)
        return table[:, :n, :k]

    def depths(self) -> torch.Tensor:
        """[B, N] distance of each node from the root."""
        return ancestor_masks(self.parents, self.max_depth).sum(-1) - 1

    def attention_masks(self) -> torch.Tensor:
        """[B, N, N] bool: node i sees node j iff j is i or one of its ancestors."""
        return ancestor_masks(self.parents, self.max_depth)


def ancestor_masks(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N, N] bool from [B, N] parent arrays (-1: no parent): row i marks i and its ancestors, found by
    following parents max_depth times (vectorized, no host sync)."""
    batch, n = parents.shape
    mask = torch.zeros(batch, n, n, dtype=torch.bool, device=parents.device)
    nodes = torch.arange(n, device=parents.device)
    anc = nodes.expand(batch, n)
    for _ in range(max_depth + 1):
        # A comparison, not one_hot: nothing here may read the device from the host (CUDA-graph capture
        # of the fused speculative step), and -1 (past the root) matches no node.
        mask |= anc[..., None] == nodes
        anc = torch.where(anc >= 0, parents.gather(1, anc.clamp_min(0)), anc)
    return mask


def _chain(depth: int):
    return [(0,) * d for d in range(1, depth + 1)]


# A few trees in the spirit of EAGLE's static trees, kept small: on a GPU every extra node costs verify
# compute at large batch, and acceptance gains beyond ~10 nodes are small for a one-layer draft.
_TREE_PATHS = {
    "chain": lambda gamma: _chain(gamma),
    # Branching 3 / 2 at the first levels, where the draft is least sure, then a chain.
    "eagle-small": lambda gamma: [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
                                  (1, 0, 0)] + _chain(gamma),
    # Top-2 at every level (2^(gamma+1) - 2 candidates): mostly for tests and small gamma.
    "binary": lambda gamma: [p for d in range(1, gamma + 1) for p in _all_paths(d, 2)],
}
TREE_NAMES = tuple(_TREE_PATHS)


def _all_paths(depth: int, width: int):
    if depth == 0:
        return [()]
    return [p + (r,) for p in _all_paths(depth - 1, width) for r in range(width)]


def get_tree(name: str, gamma: int) -> CandidateTree:
    """The named tree cut to depth <= gamma (`--speculative-tree NAME`, `--speculative-gamma`)."""
    if name not in _TREE_PATHS:
        raise ValueError(f"speculative_tree: unknown tree {name!r}, choose from {', '.join(TREE_NAMES)}")
    if gamma < 1:
        raise ValueError("speculative_gamma: must be >= 1")
    return CandidateTree.from_paths(name, [p for p in _TREE_PATHS[name](gamma) if len(p) <= gamma])


def batch_tree_mask(query_lens: list[int], masks: list[torch.Tensor | None], max_query_len: int,
                    device=None) -> torch.Tensor:
    """ForwardBatch.tree_mask [T, max_query_len] for a batch mixing tree verifies (their [n, n] mask)
    with ordinary sequences (None: causal among their own query tokens)."""
    rows = []
    for n, m in zip(query_lens, masks):
        # Built where the masks live (dynamic trees' masks are on the device): no round trip to the host.
        own = torch.ones(n, n, dtype=torch.bool, device=device).tril() if m is None else m.to(device, torch.bool)
        if own.shape != (n, n):
            raise ValueError(f"tree mask: expected [{n}, {n}], got {list(own.shape)}")
        rows.append(torch.nn.functional.pad(own, (0, max_query_len - n)))
    if not rows:
        return torch.zeros(0, max_query_len, dtype=torch.bool, device=device)
    return torch.cat(rows)


def fill_level(tree: CandidateTree, d: int, topk_ids: torch.Tensor, node_tokens: torch.Tensor) -> None:
    """Write the candidates of level d + 1 into node_tokens [B, N], given the draft's top-k token ids
    at each node of level d, topk_ids [B, len(level d), >= max_children(d)]."""
    parents = tree.level(d)
    for slot, parent in enumerate(parents):
        for child in tree.children[parent]:
            node_tokens[:, child] = topk_ids[:, slot, tree.ranks[child]]


@dataclass
class TreeVerifyOutput:
    token_ids: torch.Tensor     # [B, depth + 1] emitted tokens, padded with -1
    num_accepted: torch.Tensor  # [B] accepted candidates (emitted = num_accepted + 1)
    path_nodes: torch.Tensor    # [B, depth + 1] accepted path, root first, padded with -1

    def packed(self) -> torch.Tensor:
        """[B, 1 + 2 * (depth + 1)]: emitted count, tokens, path, so the host reads it in one transfer."""
        return torch.cat([(self.num_accepted + 1)[:, None], self.token_ids, self.path_nodes], 1)

    @staticmethod
    def unpack(rows: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """packed().tolist() -> (emitted tokens, accepted path) per request."""
        width = (len(rows[0]) - 1) // 2 if rows else 0
        return [r[1:1 + r[0]] for r in rows], [r[1 + width:1 + width + r[0]] for r in rows]

    def lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """(emitted tokens, accepted path) per request, read back in one transfer."""
        return self.unpack(self.packed().tolist())

    def token_lists(self) -> list[list[int]]:
        return self.lists()[0]


def _check_tree_inputs(tree: TreeBatch, rows: int, node_tokens: torch.Tensor) -> int:
    if node_tokens.dim() != 2 or node_tokens.shape != tree.parents.shape:
        raise ValueError(f"node_tokens: expected {list(tree.parents.shape)} like the parents, got {list(node_tokens.shape)}")
    batch = node_tokens.shape[0]
    if rows != batch * tree.num_nodes:
        raise ValueError(f"target rows: expected B * {tree.num_nodes} = {batch * tree.num_nodes}, got {rows}")
    return batch


def tree_greedy_verify(tree: TreeBatch, target_logits: torch.Tensor, node_tokens: torch.Tensor) -> TreeVerifyOutput:
    """Walk down from the root, each time into the child whose token is the target's argmax at the
    current node; emit the argmax along the path plus the one after its last node. target_logits
    [B * N, V] holds request b's node rows at b * N .. b * N + N - 1."""
    batch = _check_tree_inputs(tree, target_logits.shape[0], node_tokens)
    device = target_logits.device
    target_ids = target_logits.argmax(dim=-1).view(batch, tree.num_nodes)
    node_tokens = node_tokens.to(device)
    table = tree.children_table().to(device)
    ar = torch.arange(batch, device=device)
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    path = torch.full((batch, tree.max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    for d in range(1, tree.max_depth + 1):
        kids = table[ar, cur]                                          # [B, C]
        kid_tokens = node_tokens.gather(1, kids.clamp_min(0))
        match = (kid_tokens == target_ids[ar, cur][:, None]) & (kids >= 0) & active[:, None]
        found = match.any(dim=1)
        cur = torch.where(found, kids[ar, match.long().argmax(dim=1)], cur)
        path[:, d] = torch.where(found, cur, path[:, d])
        num_accepted += found.long()
        active &= found
    emitted = torch.where(path >= 0, target_ids.gather(1, path.clamp_min(0)), torch.full_like(path, -1))
    return TreeVerifyOutput(emitted, num_accepted, path)


def tree_rejection_verify(
    tree: TreeBatch,
    target_probs: torch.Tensor,                 # [B * N, V] from verify_probs: p at each node
    node_tokens: torch.Tensor,                  # [B, N] candidate tokens (node 0 unused)
    draft_probs: torch.Tensor | None = None,    # [B * N, V] q at each node: what its children were drawn from
) -> TreeVerifyOutput:
    """Lossless multi-candidate verification (recursive rejection sampling, as in SpecInfer / EAGLE):
    at the current node try its children in rank order; child x is accepted with probability
    min(1, p(x) / q(x)); after a rejection p becomes norm(max(0, p - q)) and q loses x. When no child
    is accepted the emitted token is drawn from the remaining p; at a leaf, from the leaf's p.

    draft_probs None means the children are the draft's deterministic top-k (distinct tokens), i.e. q
    is one-hot at each candidate; otherwise the children must have been drawn from q without
    replacement. Either way the emitted tokens follow the target distribution exactly. (Seeded rows come
    one-hot from verify_probs, so their outcome depends on no draw made here.)"""
    batch = _check_tree_inputs(tree, target_probs.shape[0], node_tokens)
    device = target_probs.device
    n = tree.num_nodes
    node_tokens = node_tokens.to(device)
    ar = torch.arange(batch, device=device)
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    path = torch.full((batch, tree.max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    p = target_probs[ar * n].float()
    table = tree.children_table().to(device)
    for d in range(1, tree.max_depth + 1):
        q = draft_probs[ar * n + cur].float() if draft_probs is not None else None
        kids = table[ar, cur]
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        for r in range(kids.shape[1]):
            trying = active & ~moved & (kids[:, r] >= 0)
            if not bool(trying.any()):
                break
            child = kids[:, r].clamp_min(0)
            x = node_tokens[ar, child]
            u = torch.rand(batch, device=device)
            p_x = p[ar, x]
            q_x = q[ar, x] if q is not None else torch.ones_like(p_x)
            accept = trying & (u * q_x < p_x)
            reject = trying & ~accept
            # Rejected rows: p <- norm(max(0, p - q)), q <- q without x (renormalized).
            if bool(reject.any()):
                q_full = q if q is not None else torch.zeros_like(p).scatter_(1, x[:, None], 1.0)
                residual = (p - q_full).clamp_min(0.0)
                mass = residual.sum(dim=-1, keepdim=True)
                new_p = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
                p = torch.where(reject[:, None], new_p, p)
                if q is not None:
                    q_wo = q.scatter(1, x[:, None], 0.0)
                    q_mass = q_wo.sum(dim=-1, keepdim=True)
                    q = torch.where(reject[:, None] & (q_mass > 0), q_wo / q_mass.clamp_min(1e-30), q)
            if bool(accept.any()):
                cur = torch.where(accept, child, cur)
                path[:, d] = torch.where(accept, child, path[:, d])
                num_accepted += accept.long()
                p = torch.where(accept[:, None], target_probs[ar * n + cur].float(), p)
                moved |= accept
        active &= moved
    final = draw(p)
    token_ids = torch.where(path >= 0, node_tokens.gather(1, path.clamp_min(0)), torch.full_like(path, -1))
    token_ids[:, 0] = -1
    # Shift: emitted token k is the token of path node k + 1; the last one is the final draw.
    emitted = torch.full_like(path, -1)
    emitted[:, :-1] = token_ids[:, 1:]
    emitted.scatter_(1, num_accepted[:, None], final[:, None])
    return TreeVerifyOutput(emitted, num_accepted, path)


def tree_kv_moves(path_nodes: list[int]) -> list[tuple[int, int]]:
    """(from, to) query offsets that commit an accepted path: path node k moves to offset k, where the
    next step expects position base + k. Offsets only move down and never onto a later source."""
    return [(node, k) for k, node in enumerate(path_nodes) if node != k]


def compact_kv(kv_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy every layer's K and V from src slots to dst slots in one gather and one scatter (kv_pool:
    [layers, 2, num_blocks, block_size, kv_heads, head_dim], slot = block * block_size + offset). The
    gather reads every source before the scatter writes, so overlapping moves are safe."""
    if src_slots.numel() == 0:
        return
    flat = kv_pool.view(-1, kv_pool.shape[2] * kv_pool.shape[3], *kv_pool.shape[4:])
    flat[:, dst_slots] = flat[:, src_slots]
