"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of a request's
longest suffix n-gram, among its own prompt and output tokens.

Each request keeps an NgramIndex: one dict from every n-gram of its tokens (lo <= n <= hi) to where its
latest occurrence ended, updated as tokens arrive, so a step never rescans a long history. Each update
also answers the lookup for the new end: the suffix n-grams are looked up, longest first, before they
are stored themselves, so the answer is an earlier occurrence.

extend_all updates a whole batch at once: every new n-gram of every request is hashed in one numpy pass,
then each request takes a few C-level dict calls (its new n-grams, the suffix lookups). Keys are 64-bit
polynomial hashes, sum over the n-gram of (t + 1) * BASE**i, newest token first: plain ints keep the
dicts out of the cyclic garbage collector's way, and a match is checked token for token before it is
used, so a collision can only hide an occurrence, never propose from a wrong one. Positions before a
sequence's start count as a token contributing 0, so an n-gram running off the start hashes as the
shorter one it holds (stored at the same end: harmless), and no lookup can verify against it.
"""
from __future__ import annotations

from itertools import repeat

import numpy as np

BASE = 0x9E3779B97F4A7C15                   # odd: its powers never vanish mod 2**64
POW = tuple(np.uint64(pow(BASE, i, 1 << 64)) for i in range(64))
# New tokens of one request past which its n-grams are stored one n at a time, sharing their end ints
# (a prompt: memory), rather than in one interleaved update (a step's few tokens: fewer calls).
LONG_RUN = 256


class NgramIndex:
    __slots__ = ("lo", "hi", "last", "length", "match")

    def __init__(self, lo: int, hi: int):
        if not 1 <= lo <= hi <= len(POW):
            raise ValueError(f"prompt_lookup_min: need 1 <= min ({lo}) <= max ({hi}) <= {len(POW)}")
        self.lo, self.hi = lo, hi
        self.last: dict[int, int] = {}   # n-gram hash -> end (index after its last token) of its latest occurrence
        self.length = 0        # tokens indexed: every n-gram ending at or before it is in `last`
        self.match = -1        # end of the latest earlier occurrence of the longest suffix n-gram (-1: none)

    def extend(self, tokens: list[int], end: int) -> None:
        """Index tokens[:end]: `tokens` is the sequence indexed so far, grown (never rewritten)."""
        extend_all([self], [tokens], [end])

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after the match (none without one), for the sequence indexed (tokens[:length]).
        Where the copy runs into the sequence's end it goes on with its own proposals: the source of
        position length + j is match + j, which past length is a proposed token (a repeating run)."""
        m, end = self.match, self.length
        if m < 0 or k <= 0:
            return []
        out = tokens[m:min(m + k, end)]
        span = end - m
        while len(out) < k:
            out.append(out[len(out) - span])
        return out


def extend_all(indexes: list[NgramIndex], sequences: list[list[int]], ends: list[int]) -> None:
    """NgramIndex.extend for each (index, sequence, end), indexes sharing one (lo, hi)."""
    jobs, flat, spans = [], [], []
    for index, tokens, end in zip(indexes, sequences, ends):
        if end > index.length:
            first = index.length + 1                       # the first new end
            base = first - index.hi                        # the first token its longest n-gram reads
            spans.append((len(flat) - 1 - base, first, end - first + 1))
            flat += [-1] * -base if base < 0 else []       # before the start: contributes 0
            flat += tokens[max(base, 0):end]
            jobs.append((index, tokens, end))
    if not jobs:
        return
    lo, hi = jobs[0][0].lo, jobs[0][0].hi
    width = hi - lo + 1
    shift, first, count = (np.asarray(col, dtype=np.int64) for col in zip(*spans))
    starts = np.repeat(np.cumsum(count) - count, count)
    ends_at = np.arange(starts.size) - starts + np.repeat(first, count)     # every new end, job by job
    newest = ends_at + np.repeat(shift, count)                             # where token end - 1 sits in flat
    tok = np.asarray(flat, dtype=np.int64).view(np.uint64) + np.uint64(1)        # -1 wraps to 0
    h = np.zeros(ends_at.size, dtype=np.uint64)
    keys = np.empty((ends_at.size, width), dtype=np.uint64)
    for i in range(hi):                                    # uint64 arithmetic wraps: mod 2**64
        h += tok[newest - i] * POW[i]
        if i + 1 >= lo:
            keys[:, i + 1 - lo] = h
    long_runs = count.max() > LONG_RUN
    columns = keys.T.tolist() if long_runs else None
    ends_list = ends_at.tolist() if long_runs else None
    keys, values = keys.ravel().tolist(), np.repeat(ends_at, width).tolist()
    row = 0
    for (index, tokens, end), c in zip(jobs, count.tolist()):
        last = index.last
        a, b = row * width, (row + c - 1) * width          # the n-grams before the end; the suffix's from b
        if c > LONG_RUN:            # a prompt: one update per n, the n-grams ending together sharing one int
            for column in columns:
                last.update(zip(column[row:row + c - 1], ends_list[row:row + c - 1]))
        elif b > a:
            last.update(zip(keys[a:b], values[a:b]))
        row += c
        match = -1
        for j in range(width - 1, -1, -1):           # the suffix, longest first, checked token for token
            m = last.get(keys[b + j], -1)
            n = lo + j
            if n <= m and tokens[m - n:m] == tokens[end - n:end]:
                match = m
                break
        index.match, index.length = match, end
        last.update(zip(keys[b:b + width], repeat(end)))


def reference_match(tokens: list[int], lo: int, hi: int) -> int:
    """The lookup by a full scan (what the index is tested against): end of the latest earlier occurrence
    of the longest suffix n-gram with lo <= n <= hi, or -1."""
    end = len(tokens)
    for n in range(min(hi, end), lo - 1, -1):
        suffix = tokens[end - n:]
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n:e] == suffix:
                return e
    return -1
