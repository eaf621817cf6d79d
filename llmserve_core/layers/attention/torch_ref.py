"""The portable torch backend: the paged-attention reference, run as a backend (CPU and CUDA)."""
from __future__ import annotations

from llmserve_core.kernels.attention_reference import paged_attention_reference
from llmserve_core.layers.attention.base import AttentionBackend
from llmserve_core.layers.batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch, scale: float,
               k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False, quant=None):
        # Host copies of the lengths, when the runner made them, spare a device sync per layer.
        seq_lens = batch.seq_lens_cpu or batch.seq_lens
        qsl = batch.query_start_loc
        if batch.query_lens_cpu:
            qsl = [0]
            for n in batch.query_lens_cpu:
                qsl.append(qsl[-1] + n)
        return paged_attention_reference(q, k_cache, v_cache, seq_lens, batch.block_tables, scale,
                                         query_start_loc=qsl, tree_mask=batch.tree_mask, k_scale=k_scale,
                                         v_scale=v_scale)
