"""Warm L2 with the next small projections of a decode layer while the GPU is busy with anything else.

At a few rows a projection is a weight stream, and the short ones (qkv_proj and o_proj: 25 and 17 MB in
FP8 at the Qwen3-8B shape) lose as much to filling and draining their pipelines as they spend streaming.
Once layer i's qkv_proj has read its weight, a side stream prefetches o_proj's weight of layer i and
qkv_proj's of layer i + 1 into L2 (kernels/l2_prefetch.py), in the DRAM time the norms, rotary, attention
and the other GEMVs' ramps leave unused; the big streams (gate_up_proj, down_proj) load with the
evict_first hint so they pass through L2 without pushing the prefetched weights out. The main stream never
waits for a prefetch until the forward ends (a late prefetch costs bandwidth, never a value), so the
chain's PDL edges stay as they are. The side stream is captured into the step's CUDA graph like the rest.
"""
from __future__ import annotations

import torch


class WeightPrefetcher:
    """mode "o": prefetch o_proj only; "oq": o_proj, then the next layer's qkv_proj. Forwards of more than
    max_rows rows (GEMMs, compute-bound) prefetch nothing."""

    def __init__(self, layers, mode: str, max_rows: int):
        assert mode in ("o", "oq"), f"WeightPrefetcher: unknown mode {mode!r}"
        self.layers, self.mode, self.max_rows = layers, mode, max_rows
        self.side: torch.cuda.Stream | None = None
        self.forked = False

    def after_qkv(self, index: int, rows: int) -> None:
        """Layer `index` has launched its qkv_proj: fork the side stream there and queue its prefetches."""
        if rows > self.max_rows:
            return
        from llmserve_core.kernels.l2_prefetch import l2_prefetch
        main = torch.cuda.current_stream()
        if self.side is None:
            self.side = torch.cuda.Stream(main.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            l2_prefetch(self.layers[index].self_attn.o_proj.weight)
            if self.mode == "oq" and index + 1 < len(self.layers):
                l2_prefetch(self.layers[index + 1].self_attn.qkv_proj.weight)
        self.forked = True

    def join(self) -> None:
        """The forward's end: the main stream takes the side stream's work back (a CUDA graph capture must)."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.side)
            self.forked = False
