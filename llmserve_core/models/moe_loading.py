"""Stream a Qwen3-MoE checkpoint's expert tensors into the stacked weights of its SparseMoeBlocks.

Two layouts come in:
- Qwen's releases (and transformers' save_pretrained, which writes the original layout): each expert apart,
  `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, FP8 releases with a scale beside each weight
  (`weight_scale_inv` per 128 x 128 block; compressed-tensors' `weight_scale` per channel or block).
- transformers' in-memory layout (save_pretrained(save_original_format=False)): one 3-D tensor per layer,
  `model.layers.L.mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `...down_proj` [E, H, I].
Each piece is read on its own (one expert at a time from a 3-D tensor) and written straight into its slot
of the preallocated stacked weight: no second copy of a layer is ever held. An FP8 expert weight or scale
goes through quantization.load_fp8_tensor, which sees one expert's slot as it sees an Fp8Linear.
"""
from __future__ import annotations

import re

import torch

from llmserve_core.kernels.fp8_format import FP8
from llmserve_core.layers.fp8_linear import quantize_rows_into
from llmserve_core.layers.moe import SparseMoeBlock
from llmserve_core.models.quantization import Fp8Scheme, load_fp8_tensor

_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)")
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj")


class _ExpertSlot:
    """One expert's [N, K] weight (and scales) inside a block's stacked w13 or w2, shaped as an Fp8Linear
    for quantization.load_fp8_tensor."""

    def __init__(self, block: SparseMoeBlock, name: str, expert: int):
        self.weight = getattr(block, name)[expert]
        scale = getattr(block, name + "_scale")
        self.weight_scale = None if scale is None else scale[expert]
        self.block = block.block
        self.out_features, self.in_features = self.weight.shape

    def quantize_rows_(self, w: torch.Tensor, row_offset: int = 0) -> None:
        quantize_rows_into(self.weight, self.weight_scale, self.block, w, row_offset)


class ExpertLoader:
    """Claims the expert tensors of a checkpoint (owns), loads each (load), then names what never came
    (missing)."""

    def __init__(self, blocks: dict[int, SparseMoeBlock], fp8: Fp8Scheme | None, shard=None, full_cfg=None):
        self.blocks, self.fp8, self.shard, self.full_cfg = blocks, fp8, shard, full_cfg
        self.done: set[tuple[int, int, str, str]] = set()     # (layer, expert, proj, "weight" | "scale")

    @staticmethod
    def owns(hf_name: str) -> bool:
        return bool(_PER_EXPERT.fullmatch(hf_name) or _STACKED.fullmatch(hf_name))

    def load(self, hf_name: str, f) -> None:
        """Load checkpoint tensor `hf_name` (owns() said yes) from the open safetensors file f."""
        if m := _PER_EXPERT.fullmatch(hf_name):
            layer, expert, proj, suffix = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            block = self._block(layer, hf_name)
            if not 0 <= expert < block.num_experts:
                raise ValueError(f"model: checkpoint tensor {hf_name!r} names expert {expert}, config.json's "
                                 f"num_experts is {block.num_experts}")
            local = self._local(block, expert)
            if local is None:
                return                                # another rank's expert (expert parallelism)
            self._load_piece(block, layer, expert, local, proj, suffix, hf_name, f.get_slice(hf_name))
            return
        m = _STACKED.fullmatch(hf_name)
        layer, which = int(m.group(1)), m.group(2)
        block = self._block(layer, hf_name)
        if self.fp8 is not None and self.fp8.prequantized:
            raise ValueError(f"model: checkpoint tensor {hf_name!r} stacks every expert in one tensor; FP8 "
                             f"checkpoints are read with each expert apart (experts.E.gate_proj.weight ...)")
        whole = f.get_slice(hf_name)
        full = self.full_cfg
        inter = block.intermediate_size if full is None else full.moe_intermediate_size
        want = ((block.num_experts, 2 * inter, block.hidden_size) if which == "gate_up" else
                (block.num_experts, block.hidden_size, inter))
        if tuple(whole.get_shape()) != want:
            raise ValueError(f"model: checkpoint tensor {hf_name!r} has shape {tuple(whole.get_shape())}, "
                             f"config.json implies {want}")
        for expert in range(block.num_experts):
            local = self._local(block, expert)
            if local is None:
                continue
            if which == "down":
                self._load_piece(block, layer, expert, local, "down", "weight", hf_name, _Rows(whole, expert))
            else:
                for proj, first in (("gate", 0), ("up", inter)):
                    self._load_piece(block, layer, expert, local, proj, "weight", hf_name,
                                     _Rows(whole, expert, first, inter))

    def missing(self) -> list[str]:
        """Checkpoint names of every expert weight (and scale) this rank needed and never got."""
        scale = self.fp8.scale_name if self.fp8 is not None and self.fp8.prequantized else None
        out = []
        for layer, block in self.blocks.items():
            kinds = ("weight", "scale") if block.fp8 and scale is not None else ("weight",)
            for expert in self._experts(block):
                for proj in ("gate", "up", "down"):
                    out += [f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.{scale if k == 'scale' else k}"
                            for k in kinds if (layer, expert, proj, k) not in self.done]
        return out

    # ---- one piece ---------------------------------------------------------------------------------

    def _load_piece(self, block: SparseMoeBlock, layer: int, expert: int, local: int, proj: str, suffix: str,
                    hf_name: str, source) -> None:
        """One expert's gate, up or down weight (or scale) into its slot; `source` is read only where indexed.
        Under tensor parallelism the rank's part is cut by the name of the piece (stacked tensors' too)."""
        piece = f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.{suffix}"
        name = "w2" if proj == "down" else "w13"
        offset = block.intermediate_size if proj == "up" else 0
        rows = block.hidden_size if proj == "down" else block.intermediate_size
        kind = "weight" if suffix == "weight" else "scale"
        if block.fp8:
            slot = _ExpertSlot(block, name, local)
            if suffix == "weight":
                tensor = source[:] if self.shard is None else self.shard.slice_checkpoint(piece, source, self.full_cfg)
            else:
                tensor = source[:] if self.shard is None else \
                    self.shard.slice_weight_scale(piece, source[:], self.full_cfg, block.block)
            load_fp8_tensor(slot, suffix, hf_name, tensor, offset, rows, self.fp8)
        else:
            if suffix != "weight":
                raise ValueError(f"model: checkpoint tensor {hf_name!r} has no place in this model: its experts "
                                 f"read 'weight' only (they are not FP8 under config.json's quantization_config)")
            tensor = source[:] if self.shard is None else self.shard.slice_checkpoint(piece, source, self.full_cfg)
            dest = getattr(block, name)[local, offset:offset + rows]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"model: checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"config.json implies {tuple(dest.shape)}")
            if tensor.dtype == FP8:
                raise ValueError(f"model: checkpoint tensor {hf_name!r} is float8_e4m3fn, but config.json's "
                                 f"quantization_config does not cover it")
            dest.copy_(tensor)
        self.done.add((layer, expert, proj, kind))

    def _block(self, layer: int, hf_name: str) -> SparseMoeBlock:
        block = self.blocks.get(layer)
        if block is None:
            raise ValueError(f"model: checkpoint tensor {hf_name!r} holds experts, but config.json makes layer "
                             f"{layer} dense (mlp_only_layers, decoder_sparse_step, or num_hidden_layers)")
        return block

    def _experts(self, block: SparseMoeBlock) -> range:
        first, count = block.expert_range
        return range(first, first + count)

    def _local(self, block: SparseMoeBlock, expert: int) -> int | None:
        first, count = block.expert_range
        return expert - first if first <= expert < first + count else None


class _Rows:
    """Expert `expert`'s [rows, K] piece of a stacked 3-D safetensors slice (rows first .. first + count, all
    when count is None), indexed like a 2-D slice: only what is indexed is read."""

    def __init__(self, whole, expert: int, first: int = 0, count: int | None = None):
        self.whole, self.expert, self.first = whole, expert, first
        self.count = whole.get_shape()[1] if count is None else count

    def get_shape(self) -> list[int]:
        return [self.count, self.whole.get_shape()[2]]

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = (index if isinstance(index, tuple) else (index, slice(None)))
        start, stop, _ = rows.indices(self.count)
        e = self.expert
        return self.whole[e:e + 1, self.first + start:self.first + stop, cols][0]
