"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder with the MLP of every
sparse layer swapped for layers/moe.py's routed experts.

A layer is sparse unless config.json lists it in mlp_only_layers or it is off the decoder_sparse_step
(ModelConfig.is_sparse_layer); the others keep Qwen3's dense MLP of intermediate_size. Everything else
(attention, norms, the forward and its aux hidden states for EAGLE-3, the logits) is Qwen3's, so the
runner, graphs and speculative executor serve it as they serve Qwen3. models/loader.py stacks the
checkpoint's per-expert tensors into the experts' packed weights (models/moe_loading.py).
"""
from __future__ import annotations

from torch import nn

from llmserve_core.layers.moe import SparseMoeBlock
from llmserve_core.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module:
        if self.cfg.is_sparse_layer(layer):
            return SparseMoeBlock(self.cfg, self.tp)
        return super().make_mlp(layer)

    def set_fused(self, fused: bool, chain: bool = False, pdl: bool = False) -> None:
        super().set_fused(fused, chain=chain, pdl=pdl)
        for m in self.model.modules():
            if isinstance(m, SparseMoeBlock):
                m.fused = fused

    def moe_blocks(self) -> list[tuple[int, SparseMoeBlock]]:
        """(layer, block) of every sparse layer."""
        return [(i, layer.mlp) for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
