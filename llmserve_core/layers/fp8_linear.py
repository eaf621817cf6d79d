"""A linear layer (no bias) whose weight is float8_e4m3fn with float32 scales.

`weight_scale` is one scale per output row ([out]) or, with a `block` (bn, bk), one per bn x bk tile
([ceil(out/bn), ceil(in/bk)]); the real weight is weight * scale either way. On CUDA, 1-16 rows take the
GEMV of kernels/fp8_gemv.py (the weight stream is the whole cost), and so do 17-64 rows of a shape its
tuned table (kernels/configs/fp8_gemv/) names a tile for: on Ada and Hopper its "a8" kernel quantizes each
row per 1 x 128 piece as it reads it and multiplies FP8 by FP8, and one row of the shapes the table gives
the stream kernel takes kernels/stream_gemv.py (weight-only), chained under PDL with the kernels around it
(kernels/fp8_gemv.choose decides which kernel runs a shape, and its tile); other rows run a
W8A8 GEMM on the FP8 tensor cores, the activations quantized dynamically (per token, or per 1 x bk piece for
block scales). A packed gate_up whose GEMV tile keeps K whole ends in the SiLU-and-mul (folds_silu_mul).
`input_quant` says how the layer wants its rows quantized ahead (fp8_format.RowQuant), and the RMSNorm or
the SiLU-and-mul before qkv, gate_up and down hands it QuantizedRows: for the W8A8 GEMM always (no
quantization launch of its own), for the GEMV where its table has a tile for x quantized ahead (tuned
where that read faster); the layer quantizes whatever else it is handed. Off the fast
path (the CPU, or the torch attention backend: see layers/fast_path.py) it computes the reference, the
dequantized weight times the input in float32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from llmserve_core.kernels.fp8_format import FP8, RowQuant, dequantize_weight, quantize_per_block, quantize_per_channel

TABLE_GEMV_MAX_ROWS = 64    # kernels/fp8_gemv.MAX_ROWS: up to here, rows may take the GEMV


class QuantizedRows(NamedTuple):
    """`rows` rows quantized ahead for an Fp8Linear (by the RMSNorm or the SiLU-and-mul before it) as its
    input_quant asked: e4m3 data and float32 scales in `quant`'s layout (fp8_format.empty_quantized: padded
    rows past `rows`); the layer's output takes `dtype`, the model's."""
    data: torch.Tensor
    scale: torch.Tensor
    quant: RowQuant
    rows: int
    dtype: torch.dtype


@torch.no_grad()
def quantize_rows_into(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
                       w: torch.Tensor, row_offset: int = 0) -> None:
    """Quantize a float w [rows, K] into rows [row_offset, row_offset + rows) of an FP8 weight [N, K] and its
    scales (per channel [N], or per block). For block scales the rows must start and end on block
    boundaries (or at the last row)."""
    rows = w.shape[0]
    if block is None:
        q, s = quantize_per_channel(w.to(weight.device))
        weight[row_offset:row_offset + rows].copy_(q)
        weight_scale[row_offset:row_offset + rows].copy_(s)
        return
    bn = block[0]
    assert row_offset % bn == 0, "block-scaled rows must start on a block boundary"
    q, s = quantize_per_block(w.to(weight.device), block)
    weight[row_offset:row_offset + rows].copy_(q)
    weight_scale[row_offset // bn:row_offset // bn + s.shape[0]].copy_(s)


class Fp8Linear(nn.Module):
    fused = False   # set by the model on the fast path: Triton GEMV / FP8 tensor-core GEMMs
    # Set by the model on Hopper: one row of a per-channel layer streams through kernels/stream_gemv.py
    # ("stream"), launched under PDL when `pdl`.
    fast_kernel: str | None = None
    pdl = False

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = tuple(block) if block is not None else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        if self.block is None:
            scale_shape = (out_features,)
        else:
            bn, bk = self.block
            scale_shape = (-(-out_features // bn), -(-in_features // bk))
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self._w8a8_inputs: dict[tuple[torch.device, torch.dtype], RowQuant] = {}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"

    @torch.no_grad()
    def quantize_rows_(self, w: torch.Tensor, row_offset: int = 0) -> None:
        """Quantize a float weight into rows [row_offset, row_offset + len(w)) of this layer (quantize_rows_into)."""
        quantize_rows_into(self.weight, self.weight_scale, self.block, w, row_offset)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, self.block)

    def input_quant(self, rows: int, dtype: torch.dtype) -> RowQuant | None:
        """How this layer wants `rows` rows of x (in `dtype`) quantized ahead (QuantizedRows): as its W8A8
        GEMM reads them, or as the GEMV's tile tuned for x quantized ahead does (kernels/fp8_gemv.choose);
        None: hand x as it is (the GEMV quantizes as it reads, or the reference path)."""
        if not self.fused or rows <= 0:
            return None
        if rows <= TABLE_GEMV_MAX_ROWS:
            if self._x_ahead_choice(rows) is not None:
                from llmserve_core.kernels.fp8_gemv import X_AHEAD_GROUP
                return RowQuant(X_AHEAD_GROUP)
            if self._gemv_choice(rows) is not None:
                return None
        return self._w8a8_input(dtype)

    def _w8a8_input(self, dtype: torch.dtype) -> RowQuant:
        """The W8A8 GEMM's activation layout: one scale per token for per-channel weights, else
        kernels/fp8_gemm.w8a8_block_input's. Fixed for a device and dtype, so asked once: an eager prefill
        step asks for every projection of every layer, and the host time is the step's."""
        key = (self.weight.device, dtype)
        if (quant := self._w8a8_inputs.get(key)) is None:
            if self.block is None:
                quant = RowQuant(self.in_features)
            else:
                from llmserve_core.kernels.fp8_gemm import w8a8_block_input
                quant = w8a8_block_input(self.weight, self.weight_scale, self.block, dtype)
            self._w8a8_inputs[key] = quant
        return quant

    def _x_ahead_choice(self, rows: int):
        """The GEMV's Choice (kernels/fp8_gemv.choose) for `rows` rows of this layer quantized ahead, on its
        device; None: hand them as they are."""
        from llmserve_core.kernels import tuned
        from llmserve_core.kernels.fp8_gemv import choose
        return choose(tuned.device_spec(self.weight.device), rows, self.out_features, self.in_features, self.block,
                      x="fp8")

    def forward(self, x: torch.Tensor | QuantizedRows, silu_mul: bool = False) -> torch.Tensor:
        """silu_mul: this is a packed [gate | up] projection of rows (handed as input_quant asks) for which
        folds_silu_mul holds; the result is SiLU(gate) * up, computed in the GEMV's epilogue."""
        if silu_mul:
            rows = x.rows if isinstance(x, QuantizedRows) else x.shape[0]
            assert self.folds_silu_mul(rows), f"Fp8Linear: no GEMV tile of {rows} rows ends in the SiLU-and-mul"
            if isinstance(x, QuantizedRows):
                return self._gemv_quantized(x, self._x_ahead_choice(rows), silu_mul=True)
            return self._gemv(x.contiguous(), self._gemv_choice(rows), silu_mul=True)
        if isinstance(x, QuantizedRows):       # input_quant's answer: the x-ahead tile's rows, else the GEMM's
            assert self.fused, "Fp8Linear: rows quantized ahead go to the fast path only"
            if x.rows <= TABLE_GEMV_MAX_ROWS and (choice := self._x_ahead_choice(x.rows)) is not None:
                return self._gemv_quantized(x, choice)
            return self._w8a8(x)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if not self.fused or x2.shape[0] == 0:
            out = (x2.float() @ self.dequantized_weight().t()).to(x.dtype)
        elif (choice := self._gemv_choice(x2.shape[0])) is not None:
            out = self._gemv(x2.contiguous(), choice)
        else:
            from llmserve_core.kernels.fp8_quant import quantize_activation
            quant = self._w8a8_input(x.dtype)
            data, scale = quantize_activation(x2.contiguous(), quant.group, quant.m_major, quant.pad_rows)
            out = self._w8a8(QuantizedRows(data, scale, quant, x2.shape[0], x.dtype))
        return out.view(*shape[:-1], self.out_features)

    def _gemv_choice(self, rows: int):
        """The GEMV's Choice (kernels/fp8_gemv.choose: the tuned table's kernel and tile, the stream kernel's at
        one row only on the decode chain, the heuristic's for 1-16 untuned rows) for `rows` rows of this layer
        handed as they are. None: the W8A8 GEMM."""
        if rows > TABLE_GEMV_MAX_ROWS:
            return None
        from llmserve_core.kernels import tuned
        from llmserve_core.kernels.fp8_gemv import choose
        return choose(tuned.device_spec(self.weight.device), rows, self.out_features, self.in_features, self.block,
                      stream=self.fast_kernel == "stream" and rows == 1 and self._streams())

    def folds_silu_mul(self, rows: int) -> bool:
        """Whether forward can end `rows` rows of this packed [gate | up] weight, handed as input_quant asks,
        in the SiLU-and-mul: where they meet a GEMV tile that does not split K (the stream kernel's, where
        stream_gemv.silu_mul_fits: with block scales, on whole rows only)."""
        if not self.fused or not 0 < rows <= TABLE_GEMV_MAX_ROWS or self.out_features % 2:
            return False
        choice = self._x_ahead_choice(rows) or self._gemv_choice(rows)     # what forward runs, or the GEMM
        if choice is None:
            return False
        if choice.kernel == "stream":
            from llmserve_core.kernels.stream_gemv import silu_mul_fits
            return silu_mul_fits(self.out_features, choice.tile, self.block)
        from llmserve_core.kernels.fp8_gemv import silu_mul_fits
        return silu_mul_fits(self.out_features, choice)

    def _gemv(self, x: torch.Tensor, choice, silu_mul: bool = False) -> torch.Tensor:
        """The GEMV _gemv_choice chose, launched under PDL on the decode chain."""
        if choice.kernel == "stream":
            from llmserve_core.kernels.stream_gemv import stream_gemv
            return stream_gemv(x, self.weight, self.weight_scale, self.block, pdl=self.pdl, config=choice.tile,
                               silu_mul=silu_mul)
        from llmserve_core.kernels.fp8_gemv import fp8_gemv
        return fp8_gemv(x, self.weight, self.weight_scale, self.block, kernel=choice.kernel, config=choice.tile,
                        pdl=self.pdl and not choice.kernel.startswith("fma"), silu_mul=silu_mul)

    def _gemv_quantized(self, x: QuantizedRows, choice, silu_mul: bool = False) -> torch.Tensor:
        """Rows quantized ahead for the GEMV: the a8 kernel at the tile tuned for them."""
        from llmserve_core.kernels.fp8_gemv import fp8_gemv
        return fp8_gemv(x.data, self.weight, self.weight_scale, self.block, kernel=choice.kernel, config=choice.tile,
                        pdl=self.pdl, x_scale=x.scale, x_group=x.quant.group, out_dtype=x.dtype, silu_mul=silu_mul)

    def _streams(self) -> bool:
        """Whether kernels/stream_gemv.py takes this layer's shape: a K its tiles divide, and block
        scales whose rows its programs do not split."""
        from llmserve_core.kernels.stream_gemv import MIN_BLOCK_K, ROWS_PER_PROGRAM
        return self.in_features % MIN_BLOCK_K == 0 and (self.block is None or self.block[0] % ROWS_PER_PROGRAM == 0)

    def _w8a8(self, x: QuantizedRows) -> torch.Tensor:
        """The W8A8 GEMM on rows quantized as _w8a8_input says; [rows, out_features]."""
        from llmserve_core.kernels.fp8_gemm import w8a8_block_gemm, w8a8_gemm_per_channel
        if self.block is None:
            return w8a8_gemm_per_channel(x.data, x.scale, self.weight, self.weight_scale, x.dtype)
        return w8a8_block_gemm(x.data, x.scale, x.quant, self.weight, self.weight_scale, self.block,
                               x.dtype)[:x.rows]
