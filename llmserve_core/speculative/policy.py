"""How much to draft each step, so that speculation never serves slower than plain decoding.

Every step the engine asks the policy for a draft depth: 0 (a plain step, on the ordinary fast path)
or one of the configured depths. The choice maximizes expected emitted tokens per second,

    rate(g) = (plain requests + speculative requests * E[emitted | g]) / cost(batch bucket, g),

with E[emitted | g] = 1 + sum_{j <= g} prod_{i <= j} c_i from the per-position conditional acceptance
c_i measured online (decayed counts, so it follows the traffic), and costs from a cost model: on a real
engine the median wall time of recent steady steps on this machine (MeasuredCosts), in tests a fake.
A cost not measured yet is guessed from the nearest measured bucket, or from a deliberately hopeful
prior, so the policy tries drafting once and then decides on what it measured. A drafting step is never
taken to cost less than a plain one.

When plain wins, drafting stops and so does measuring acceptance; a probe now and then drafts anyway
(one step in N, N doubling while acceptance stays useless, reset once drafting pays again), so a
workload that turns predictable is noticed cheaply.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Protocol


def batch_bucket(n: int) -> int:
    """Costs are keyed by the next power of two of the batch size."""
    return 1 << max(0, int(n) - 1).bit_length()


class CostModel(Protocol):
    def step_seconds(self, bucket: int, width: int) -> float | None:
        """Seconds of one engine step for a batch bucket, at `width` verify rows per drafting request
        (1: a plain step); None when nothing is known."""


class MeasuredCosts:
    """Step wall time keyed by (batch bucket, width): the median of the last `window` samples.

    A median, not a moving average: one stalled step (a collection, a page fault, a burst of host work)
    would otherwise inflate a cost for many steps, and a plain cost that looks high makes drafting look
    cheap; once the policy stops taking plain steps, nothing would bring that estimate back down."""

    def __init__(self, window: int = 9):
        if window < 1:
            raise ValueError("window: need at least one sample")
        self.window = window
        self.samples: dict[tuple[int, int], deque[float]] = {}
        self.median: dict[tuple[int, int], float] = {}

    def record(self, bucket: int, width: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        key = (bucket, width)
        kept = self.samples.setdefault(key, deque(maxlen=self.window))
        kept.append(seconds)
        self.median[key] = statistics.median(kept)

    def step_seconds(self, bucket: int, width: int) -> float | None:
        known = self.median.get((bucket, width))
        if known is not None or width == 1:
            return known
        plain = self.median.get((bucket, 1))
        if plain is None:
            return None
        # Unmeasured here: the speculative / plain cost ratio of the nearest bucket that has both.
        others = [b for (b, w) in self.median if w == width and (b, 1) in self.median]
        if not others:
            return None
        near = min(others, key=lambda b: abs(math.log2(b) - math.log2(bucket)))
        return plain * self.median[(near, width)] / self.median[(near, 1)]


class AcceptanceModel:
    """P(draft j accepted | drafts 1..j-1 accepted), per position, from decayed counts with a prior worth
    `prior_weight` observations."""

    def __init__(self, depth: int, prior: float = 0.6, prior_weight: float = 1.0, decay: float = 0.9):
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.accepted = [0.0] * depth
        self.tried = [0.0] * depth

    def record(self, num_accepted: list[int], num_drafted: int) -> None:
        """One engine step: each drafting request accepted num_accepted[r] of its num_drafted drafts
        (trees: the accepted path's length of a tree num_drafted deep)."""
        if not num_accepted:
            return
        for j in range(min(num_drafted, len(self.tried))):
            # Position j is tried by every request that accepted all before it.
            tried = sum(1 for a in num_accepted if a >= j)
            self.tried[j] = self.decay * self.tried[j] + tried
            self.accepted[j] = self.decay * self.accepted[j] + sum(1 for a in num_accepted if a > j)

    def conditional(self, j: int) -> float:
        w = self.prior_weight
        return (self.accepted[j] + w * self.prior) / (self.tried[j] + w)

    def expected_emitted(self, depth: int) -> float:
        total, reach = 1.0, 1.0
        for j in range(depth):
            reach *= self.conditional(j)
            total += reach
        return total


@dataclass(frozen=True)
class Decision:
    gamma: int                  # drafts per step (tree: the tree's depth); 0: a plain step
    probe: bool = False         # drafting only to re-measure acceptance


class SpecPolicy:
    """`widths` maps each allowed draft depth to the verify rows it costs per request (chain: depth + 1;
    a tree: its node count); `mode` "always" drafts at the deepest every step."""

    def __init__(self, widths: dict[int, int], mode: str = "adaptive", prior_cost_per_draft: float = 0.25,
                 probe_every: int = 8, probe_every_max: int = 1024, switch_margin: float = 0.05,
                 acceptance: AcceptanceModel | None = None):
        if not widths or min(widths) < 1:
            raise ValueError("widths: need at least one draft depth >= 1")
        if mode not in ("adaptive", "always"):
            raise ValueError("speculative_policy: must be adaptive or always")
        self.widths = dict(sorted(widths.items()))
        self.deepest = max(self.widths)
        self.mode = mode
        self.prior_cost_per_draft = prior_cost_per_draft
        # Drafting must beat plain decoding by this margin, every step. Leaving plain decoding costs a
        # warm-up step (draft states have gaps) and, on a GPU, the async pipeline; and a draft that is
        # barely ever accepted, at a cost measured about equal to plain (noise), must not keep the engine
        # drafting on a near tie, which a margin applied only on the way in allowed.
        self.switch_margin = switch_margin
        self.acceptance = acceptance or AcceptanceModel(self.deepest)
        self.probe_base, self.probe_max = probe_every, probe_every_max
        self.probe_every = probe_every
        self.plain_run = 0              # plain steps since the last drafting step
        self.probe_left = 0             # steps left in the probe under way (the first may only warm the draft up)
        self.last = Decision(self.deepest if mode == "always" else 0)
        self.pinned: int | None = None   # a depth every step drafts at, whatever the rates say (warm-up)
        self.num_drafted_steps = self.num_plain_steps = self.num_probe_steps = 0
        self.last_bucket = 1             # the batch bucket of the latest rate comparison

    def cost_ratio(self, costs: CostModel) -> float:
        """Full-depth drafting step cost over a plain step's at the latest bucket (0.0: not known yet)."""
        plain = costs.step_seconds(self.last_bucket, 1)
        deep = costs.step_seconds(self.last_bucket, self.widths[self.deepest])
        return deep / plain if plain and deep else 0.0

    def expected_rate(self, gamma: int, bucket: int, num_plain: int, num_spec: int, costs: CostModel) -> float:
        plain_cost = costs.step_seconds(bucket, 1)
        if gamma == 0:
            return (num_plain + num_spec) / plain_cost
        cost = costs.step_seconds(bucket, self.widths[gamma])
        if cost is None:
            cost = plain_cost * (1.0 + self.prior_cost_per_draft * gamma)
        # A drafting step does all of a plain step's work and more, so a measurement that says otherwise
        # (noise, or a plain cost taken while the machine was busy elsewhere) is not believed.
        cost = max(cost, plain_cost)
        return (num_plain + num_spec * self.acceptance.expected_emitted(gamma)) / cost

    def decide(self, batch: int, num_speculative: int, costs: CostModel) -> Decision:
        """The draft depth for a step of `batch` running requests, `num_speculative` of which draft."""
        self.last = self._decide(batch, num_speculative, costs)
        if self.last.gamma:
            self.num_drafted_steps += 1
            self.num_probe_steps += self.last.probe
        else:
            self.num_plain_steps += 1
        return self.last

    def _decide(self, batch: int, num_spec: int, costs: CostModel) -> Decision:
        if self.pinned is not None:
            return Decision(self.pinned)
        if self.mode == "always":
            return Decision(self.deepest)
        if num_spec == 0:
            return Decision(0)
        bucket = self.last_bucket = batch_bucket(batch)
        if costs.step_seconds(bucket, 1) is None:
            return Decision(0)                   # measure plain steps first: they are the baseline
        if self.probe_left:
            self.probe_left -= 1
            return Decision(self.deepest, probe=True)
        rates = {g: self.expected_rate(g, bucket, batch - num_spec, num_spec, costs) for g in (0, *self.widths)}
        rates[0] *= 1.0 + self.switch_margin
        best = max(rates, key=lambda g: (rates[g], -g))      # ties: draft less
        if best:
            self.plain_run, self.probe_every = 0, self.probe_base
            return Decision(best)
        self.plain_run += 1
        if self.plain_run >= self.probe_every:
            self.plain_run = 0
            self.probe_every = min(2 * self.probe_every, self.probe_max)
            self.probe_left = 2
            return Decision(self.deepest, probe=True)
        return Decision(0)

    def observe(self, decision: Decision, num_accepted: list[int]) -> None:
        """What a drafting step accepted, per drafting request (none: every request was still warming up
        its draft state after plain steps, so a probe goes on for another step)."""
        if num_accepted:
            self.acceptance.record(num_accepted, decision.gamma)
            if decision.probe:
                self.probe_left = 0              # measured: back to deciding on rates
