"""A bias-free linear layer whose decode-sized forward can stream its weight through a Triton GEMV.

`Linear` holds a weight [out, in] under the checkpoint's name. The model picks its fast kernel: the
lm_head takes kernels.gemv for 1-64 rows (on the 152k-row head it beats cuBLAS); on Hopper the decoder's
projections take kernels.stream_gemv for a single row (a batch-1 decode) and kernels.gemv for 2-16 rows
where its measured table has the shape, chained under PDL with the kernels around them. Everywhere else
it is F.linear, which is also the reference the fast paths are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# kernels.gemv's MAX_ROWS and PROJECTION_MAX_ROWS, repeated so that a CPU-only install without Triton never
# imports the kernels.
MAX_ROWS = 64
PROJECTION_MAX_ROWS = 16


class Linear(nn.Module):
    # Set by the model on the fast path: "gemv" (the lm_head: kernels/gemv.py for 1-64 rows) or "stream"
    # (the decoder's projections: kernels/stream_gemv.py for one row, kernels/gemv.py for 2-16 rows at a
    # measured shape, launched under PDL when `pdl`).
    fast_kernel: str | None = None
    pdl = False

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.fast_kernel == "gemv" and 0 < x.shape[0] <= MAX_ROWS:
            from llmserve_core.kernels.gemv import gemv
            return gemv(x, self.weight, out_dtype=out_dtype)
        if self.fast_kernel == "stream" and 0 < x.shape[0] <= PROJECTION_MAX_ROWS and x.stride(-1) == 1:
            if x.shape[0] == 1:
                from llmserve_core.kernels.stream_gemv import MIN_BLOCK_K, stream_gemv
                if self.in_features % MIN_BLOCK_K == 0:
                    return stream_gemv(x, self.weight, out_dtype=out_dtype, pdl=self.pdl)
            else:
                from llmserve_core.kernels.gemv import gemv, projection_launch_config
                cfg = projection_launch_config(x, self.weight)
                if cfg is not None:
                    return gemv(x, self.weight, out_dtype=out_dtype, config=cfg, pdl=self.pdl)
        y = F.linear(x, self.weight)
        return y if out_dtype is None else y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"
