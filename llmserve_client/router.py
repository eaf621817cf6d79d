"""Which core takes a request, when a client or frontend serves over several cores (data parallelism).

Pure policy, no sockets: the caller says which cores are up and how loaded each is, the router answers.

- A prompt of at least one full KV block is keyed by a hash of its first block of token ids (the unit the
  cores' prefix caches share). The first request with a key goes to the least loaded core; later ones
  with the same key follow it there, where its prefix blocks are cached, while that core is up and not
  badly overloaded (more than OVERLOAD_FACTOR times the least loaded core's load plus OVERLOAD_SLACK).
  An overloaded or dead core's keys move to the least loaded core and stay there.
- Among equally loaded cores a key picks by rendezvous hashing, so unrelated prompts spread evenly and a
  key's first choice does not depend on the order requests came in.
- A prompt shorter than a block shares nothing worth routing on: the least loaded core, ties in turn.

Load is the caller's number per core, e.g. requests in flight from here plus what the core's own stats
say others sent it.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
from array import array

OVERLOAD_FACTOR = 2        # a core keeps its prefixes until its load exceeds FACTOR x the least + SLACK
OVERLOAD_SLACK = 8
MAX_REMEMBERED_PREFIXES = 65536


def prefix_key(token_ids: list[int], block_size: int) -> bytes | None:
    """Digest of the prompt's first full block of token ids; None when the prompt is shorter than a block."""
    if block_size <= 0 or len(token_ids) < block_size:
        return None
    return hashlib.blake2b(array("q", token_ids[:block_size]).tobytes(), digest_size=16).digest()


def _rendezvous(key: bytes, core: str) -> bytes:
    return hashlib.blake2b(key + core.encode(), digest_size=8).digest()


def overloaded(load: float, least: float) -> bool:
    return load > OVERLOAD_FACTOR * least + OVERLOAD_SLACK


class Router:
    def __init__(self, core_names: list[str], block_size: int):
        if not core_names:
            raise ValueError("core_names: need at least one core")
        self.names = list(core_names)
        self.block_size = block_size
        self._homes: collections.OrderedDict[bytes, int] = collections.OrderedDict()   # key -> core, LRU order
        self._turn = itertools.count()

    def pick(self, token_ids: list[int], loads: list[float], up: list[bool]) -> int:
        """The core for a request with this prompt (an index into core_names); loads and up per core, and
        at least one core up."""
        alive = [i for i, ok in enumerate(up) if ok]
        if not alive:
            raise ValueError("up: no core is up")
        least = min(loads[i] for i in alive)
        idle = [i for i in alive if loads[i] == least]
        key = prefix_key(token_ids, self.block_size)
        if key is None:
            return idle[next(self._turn) % len(idle)]
        home = self._homes.get(key)
        if home is not None and up[home] and not overloaded(loads[home], least):
            self._homes.move_to_end(key)
            return home
        home = max(idle, key=lambda i: _rendezvous(key, self.names[i]))
        self._homes[key] = home
        self._homes.move_to_end(key)
        if len(self._homes) > MAX_REMEMBERED_PREFIXES:
            self._homes.popitem(last=False)
        return home
