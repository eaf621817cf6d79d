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

# kernels.gemv's MAX_ROWS and PROJECTION_MAX_ROWS and kernels.stream_gemv's MIN_BLOCK_K, repeated so that a
# CPU-only install without Triton never imports the kernels.
MAX_ROWS = 64
PROJECTION_MAX_ROWS = 16
STREAM_MIN_BLOCK_K = 64


class Projection(nn.Module):
    """What the decoder asks of any of its projections (Linear, layers.fp8_linear.Fp8Linear): a forward, and
    the forward of the normalized or SiLU-gated input, which a projection whose kernel can compute that
    input itself (`streams`) folds into one launch."""

    def streams(self, x: torch.Tensor) -> bool:
        """Whether this forward of x runs the kernel that folds the prologues: only a subclass says so."""
        return False

    def normed(self, norm, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this projection of norm(h + residual), the residual stream h + residual); at the first layer
        (no residual) of norm(h), with h as the stream. On the decode chain at one row, one kernel: the norm
        rides in the GEMV's reading of x. norm: a layers.norm.RMSNorm."""
        if self.streams(h):
            from llmserve_core.kernels.stream_gemv import stream_gemv
            return stream_gemv(h, self.weight, pdl=self.pdl, norm=(norm.weight, norm.eps), residual=residual)
        if residual is None:
            return self(norm(h)), h
        x, residual = norm(h, residual)
        return self(x), residual

    def after_silu(self, gate_up: torch.Tensor, silu_mul) -> torch.Tensor:
        """This projection of SiLU(gate) * up, gate_up a packed [T, 2 * in_features] [gate | up]; silu_mul
        computes that product where no kernel folds it into the GEMV (on the decode chain at one row)."""
        if self.streams(gate_up):
            from llmserve_core.kernels.stream_gemv import stream_gemv
            return stream_gemv(gate_up, self.weight, pdl=self.pdl, silu=True)
        return self(silu_mul(gate_up))


class Linear(Projection):
    # Set by the model on the fast path: "gemv" (the lm_head: kernels/gemv.py for 1-64 rows) or "stream"
    # (the decoder's projections: kernels/stream_gemv.py for one row, kernels/gemv.py for 2-16 rows at a
    # measured shape, launched under PDL when `pdl`).
    fast_kernel: str | None = None
    pdl = False

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def streams(self, x: torch.Tensor) -> bool:
        """Whether x (or the row a prologue makes of it) goes through kernels/stream_gemv.py: one contiguous
        row on the decode chain, at a K its tiles divide."""
        return (self.fast_kernel == "stream" and x.shape[0] == 1 and x.stride(-1) == 1
                and self.in_features % STREAM_MIN_BLOCK_K == 0)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.fast_kernel == "gemv" and 0 < x.shape[0] <= MAX_ROWS:
            from llmserve_core.kernels.gemv import gemv
            return gemv(x, self.weight, out_dtype=out_dtype)
        if self.fast_kernel == "stream" and 0 < x.shape[0] <= PROJECTION_MAX_ROWS and x.stride(-1) == 1:
            if self.streams(x):
                from llmserve_core.kernels.stream_gemv import stream_gemv
                return stream_gemv(x, self.weight, out_dtype=out_dtype, pdl=self.pdl)
            if x.shape[0] > 1:
                from llmserve_core.kernels.gemv import gemv, projection_launch_config
                cfg = projection_launch_config(x, self.weight)
                if cfg is not None:
                    return gemv(x, self.weight, out_dtype=out_dtype, config=cfg, pdl=self.pdl)
        y = F.linear(x, self.weight)
        return y if out_dtype is None else y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"
