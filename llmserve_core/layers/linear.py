"""A bias-free linear layer whose decode-sized forward can stream its weight through kernels.gemv.

`Linear` holds a weight [out, in] under the checkpoint's name. Where the model turns `fast` on (it does
for the lm_head, the one shape where the Triton kernel beats cuBLAS: see kernels/gemv.py) and at most
MAX_ROWS rows come in, the matmul is kernels.gemv; everywhere else it is F.linear, which is also the
reference the fast path is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# kernels.gemv.MAX_ROWS, repeated so that a CPU-only install without Triton never imports the kernels.
MAX_ROWS = 16


class Linear(nn.Module):
    fast = False

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.fast and 0 < x.shape[0] <= MAX_ROWS:
            from llmserve_core.kernels.gemv import gemv
            return gemv(x, self.weight, out_dtype=out_dtype)
        y = F.linear(x, self.weight)
        return y if out_dtype is None else y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"
