"""The sparse mixture-of-experts MLP of a Qwen3-MoE layer: a router and stacked experts.

The router is a bias-free linear to one logit per expert (the checkpoint's `mlp.gate.weight`), computed in
the model dtype; each token takes the top-k of its softmax (in float32), renormalised when the config says
norm_topk_prob, and the layer returns the weighted sum of those experts' SiLU-gated MLPs. The experts are
stacked per layer as kernels/moe_reference.py lays them out (w13 [E, 2I, H]: gate rows then up rows;
w2 [E, H, I]), in the model dtype or float8_e4m3fn with float32 scales (per output channel, or per block).
On the fast path (layers/fast_path.py) routing and the experts run in kernels/fused_moe.py's Triton kernels;
elsewhere in the torch references they are tested against.
"""
from __future__ import annotations

import torch
from torch import nn

from llmserve_core.kernels.fp8_format import FP8
from llmserve_core.kernels.moe_reference import fused_moe_reference, route_reference
from llmserve_core.layers.fp8_linear import quantize_rows_into


class SparseMoeBlock(nn.Module):
    fused = False   # set by the model on the fast path: kernels/fused_moe.py

    def __init__(self, cfg, tp=None):
        """cfg: a models.config.ModelConfig, under tensor parallelism this rank's (ShardSpec.local_config):
        its moe_intermediate_size is the rank's slice of every expert's, or with expert parallelism every
        expert's whole, the rank holding only tp.shard.experts. Either way the product is a partial sum,
        all-reduced here as the dense MLP's is."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.hidden_size, self.intermediate_size = hidden, inter
        # (first, count) of the experts this block holds: all of them, but for expert parallelism's share.
        self.expert_range = (0, cfg.num_experts) if tp is None else tp.shard.experts
        self.expert_parallel = self.expert_range[1] != cfg.num_experts
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(self.expert_range[1], 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(self.expert_range[1], hidden, inter))
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)
        self.block: tuple[int, int] | None = None
        self.tp = tp

    @property
    def fp8(self) -> bool:
        return self.w13_scale is not None

    def make_fp8(self, block: tuple[int, int] | None) -> None:
        """Hold the experts in float8_e4m3fn with float32 scales (per output channel, or per `block` tile);
        the router stays in the model dtype. Called on the still-unallocated (meta) model."""
        self.block = tuple(block) if block is not None else None
        device = self.w13.device
        for name in ("w13", "w2"):
            experts, rows, cols = getattr(self, name).shape
            setattr(self, name, nn.Parameter(torch.empty(experts, rows, cols, dtype=FP8, device=device),
                                             requires_grad=False))
            scale = (experts, rows) if block is None else (experts, -(-rows // block[0]), -(-cols // block[1]))
            setattr(self, name + "_scale", nn.Parameter(torch.empty(scale, dtype=torch.float32, device=device),
                                                        requires_grad=False))

    @torch.no_grad()
    def quantize_expert_(self, name: str, expert: int, w: torch.Tensor, row_offset: int = 0) -> None:
        """Quantize a float w [rows, K] into rows [row_offset, row_offset + rows) of expert `expert` of
        `name` ("w13" or "w2"), as Fp8Linear.quantize_rows_ does for a dense weight."""
        quantize_rows_into(getattr(self, name)[expert], getattr(self, name + "_scale")[expert], self.block, w,
                           row_offset)

    def forward(self, x: torch.Tensor, live_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. live_rows ([1] int32 on the device, ForwardBatch's): rows from it on are a CUDA
        graph's padding, which the fused path routes to no expert (their output is then 0; the reference
        path computes them, to be dropped)."""
        logits = self.gate(x)
        if self.fused:
            from llmserve_core.kernels.fused_moe import fused_moe, route
            # Another rank's experts (expert parallelism) get id -1, which adds nothing here.
            weights, ids = route(logits, self.top_k, self.renormalize, valid_rows=live_rows,
                                 experts=self.expert_range if self.expert_parallel else None)
        else:
            fused_moe = fused_moe_reference
            weights, ids = route_reference(logits, self.top_k, self.renormalize)
            if self.expert_parallel:
                first, count = self.expert_range
                local = ids - first
                ids = torch.where((local >= 0) & (local < count), local, torch.full_like(local, -1))
        out = fused_moe(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale, self.block)
        return out if self.tp is None else self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, held={self.expert_range}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, fp8={self.fp8}, block={self.block}")
