"""Speculative decoding's runtime: the drafting step (executor.py) around one seam (proposer.py).

  executor.py            a drafting step's orchestration, its phases, metrics and stats
  proposer.py            the seam: Proposer (how drafts are made), Proposal, Verified, SpecContext
  verifier.py            what every method shares: the target forward with verify rows, greedy or
                         lossless rejection-sampled verification, a tree's KV compaction
  eagle.py               EAGLE-3's proposer: the draft head's KV, catch-up and graphs, per-request state
  eagle_chain.py         EAGLE-3 chain drafting
  eagle_tree.py          what static and dynamic trees share (level batches, the fused tree step)
  eagle_static_tree.py   EAGLE-3 static (named) trees
  eagle_dynamic_tree.py  EAGLE-3 dynamic trees
  ngram.py               prompt lookup: drafts copied from each request's own tokens (no model)
  state.py               SpecState: a request's draft rows, and which are valid
The algorithms themselves (proposal, verification, trees, the n-gram index, the policy) live in
llmserve_core/speculative/.
"""
