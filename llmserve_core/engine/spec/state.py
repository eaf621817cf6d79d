"""A request's EAGLE draft progress: which of its draft KV rows are written, and which are valid."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecState:
    """Draft KV rows below draft_pos are written; `pending` holds the fused aux states of positions
    draft_pos .. num_computed_tokens - 1, whose draft rows wait for the token after them (known by the time
    the request is next scheduled). Requests that do not draft keep one too, so the blocks they publish
    carry draft rows.

    Gaps: a plain step (the adaptive policy's "no drafting") computes target KV without aux states, so
    those positions never get draft rows. Rows from first_invalid on (None: no gap) are therefore not
    what the draft would have computed: later draft forwards read them anyway, which costs acceptance
    but never exactness (verification decides every token). The prefix cache keeps this honest: blocks
    are published with a flag saying whether their draft rows are valid (below valid_until), and a
    request served from the cache starts its first_invalid at the first block without."""
    draft_pos: int | None = None        # None: not started
    pending: torch.Tensor | None = None
    first_invalid: int | None = None

    def start(self, num_computed: int, valid_prefix: int) -> None:
        """Begin at num_computed (the prefix cache's hit, or 0); draft rows below valid_prefix are valid."""
        self.draft_pos, self.pending = num_computed, None
        self.first_invalid = valid_prefix if valid_prefix < num_computed else None

    def sync(self, num_computed: int) -> None:
        """Catch up with the request's KV after steps that did not draft: positions draft_pos ..
        num_computed - 1 never got (or, with pending aux dropped, never will get) draft rows."""
        rows = 0 if self.pending is None else self.pending.shape[0]
        if self.draft_pos + rows != num_computed:
            if self.first_invalid is None or self.first_invalid > self.draft_pos:
                self.first_invalid = self.draft_pos
            self.draft_pos, self.pending = num_computed, None

    def publish_limits(self, num_computed: int) -> tuple[int, int]:
        """(publish full blocks below, their draft rows are valid below). Without a gap, blocks wait
        until their draft rows exist (below draft_pos: the pending rows get theirs next step); after a
        gap the rows past it stay invalid, so every computed block may go, flagged."""
        if self.first_invalid is None:
            return self.draft_pos, self.draft_pos
        return num_computed, self.first_invalid
