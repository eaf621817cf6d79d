"""What one speculative step produced for a request, and the running metrics over many steps.

Acceptance length follows the EAGLE papers: tokens emitted per verify step, including the bonus or
correction token, so a step that rejects everything still has length 1.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

TIMING_KEYS = ("draft", "verify", "accept", "kv_update", "trace")


@dataclass
class SpecStepResult:
    token_ids: list[int]                 # emitted this step: accepted drafts, then the correction/bonus token
    num_draft: int                       # draft tokens proposed along the verified chain (tree: its depth)
    num_accepted: int                    # drafts kept (len(token_ids) - 1)
    accepted_nodes: list[int] | None = None   # tree mode: node indices of the accepted path, root first

    def __post_init__(self):
        if self.num_accepted != len(self.token_ids) - 1 or not 0 <= self.num_accepted <= self.num_draft:
            raise ValueError(f"num_accepted: {self.num_accepted} does not fit {len(self.token_ids)} tokens "
                             f"and {self.num_draft} drafts")


@dataclass
class SpecMetrics:
    num_steps: int = 0                   # request-steps that ran a verify
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    position_drafted: list[int] = field(default_factory=list)   # [j]: steps that had a draft at position j
    position_accepted: list[int] = field(default_factory=list)  # [j]: steps whose draft j was accepted
    timings: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in TIMING_KEYS})
    num_batches: int = 0                 # engine steps (one draft + verify over the whole batch)

    def record(self, results: list[SpecStepResult]) -> None:
        self.num_batches += 1
        for r in results:
            self.num_steps += 1
            self.num_draft_tokens += r.num_draft
            self.num_accepted_tokens += r.num_accepted
            self.num_emitted_tokens += len(r.token_ids)
            grow = r.num_draft - len(self.position_drafted)
            if grow > 0:
                self.position_drafted.extend([0] * grow)
                self.position_accepted.extend([0] * grow)
            for j in range(r.num_draft):
                self.position_drafted[j] += 1
                self.position_accepted[j] += j < r.num_accepted

    def add_time(self, key: str, seconds: float) -> None:
        if key not in self.timings:
            raise ValueError(f"timing key: unknown {key!r}, choose from {', '.join(TIMING_KEYS)}")
        self.timings[key] += seconds

    @contextmanager
    def timer(self, key: str, sync=None):
        """Time a phase; pass `sync` (e.g. torch.cuda.synchronize) so GPU work is counted where it runs."""
        if sync is not None:
            sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if sync is not None:
                sync()
            self.add_time(key, time.perf_counter() - start)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft j accepted | it was proposed), which includes needing every earlier draft accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def as_dict(self) -> dict:
        steps = max(self.num_batches, 1)
        return {
            "spec_num_steps": self.num_steps,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_acceptance_length": self.mean_acceptance_length,
            "spec_per_position_acceptance": self.per_position_acceptance,
            "spec_draft_tokens_per_step": self.num_draft_tokens / steps,
            "spec_accepted_tokens_per_step": self.num_accepted_tokens / steps,
            "spec_timings_s": dict(self.timings),
        }
