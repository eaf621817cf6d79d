"""RMSNorm with an optional fused residual add (the vLLM calling convention).

`norm(x)` returns the normalized x. `norm(x, residual)` first forms the residual stream
x + residual and returns (normalized stream, stream), so a decoder layer never materializes the
add separately. Statistics are taken in float32 and the result is cast back before the weight
multiply, exactly as transformers' Qwen3RMSNorm does, so float32 and bf16 both match it bit for bit.
"""
from __future__ import annotations

import torch
from torch import nn

from llmserve_core.kernels.fp8_format import RowQuant


class RMSNorm(nn.Module):
    # Set by the model on CUDA: one Triton kernel (kernels/rmsnorm.py) instead of about seven eager ones.
    fused = False
    pdl = False     # set with `fused` on Hopper: launched under PDL (kernels/pdl.py)

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant: RowQuant | None = None):
        """quant (the fused kernel only): the normalized rows leave quantized for the Fp8Linear after the
        norm, as its input_quant asked (layers/fp8_linear.QuantizedRows)."""
        if self.fused:
            from llmserve_core.kernels.rmsnorm import rmsnorm
            out = rmsnorm(x, self.weight, self.eps, residual, pdl=self.pdl, quant=quant)
            if quant is None:
                return out
            from llmserve_core.layers.fp8_linear import QuantizedRows
            (data, scale), stream = (out, None) if residual is None else out
            rows = QuantizedRows(data, scale, quant, x.shape[0], x.dtype)
            return rows if residual is None else (rows, stream)
        assert quant is None, "RMSNorm: quantized rows come from the fused kernel only"
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
