"""A speculation policy that decides from a fixed random script, so every switch between plain and drafting
steps is exercised whatever the measurements say."""
from __future__ import annotations

import random

from llmserve_core.speculative.policy import Decision, SpecPolicy


class ScriptedPolicy(SpecPolicy):
    """Decides from a fixed random script instead of measurements, so every switch is exercised."""

    def __init__(self, widths, seed, plain_share=0.5):
        super().__init__(widths)
        rnd = random.Random(seed)
        depths = list(widths)
        self.script = [0 if rnd.random() < plain_share else rnd.choice(depths) for _ in range(4096)]
        self.calls = 0

    def _decide(self, batch, num_spec, costs):
        self.calls += 1
        return Decision(self.script[self.calls % len(self.script)])
