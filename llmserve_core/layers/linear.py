"""A bias-free linear layer whose decode-sized forward can stream its weight through a Triton GEMV.

`Linear` holds a weight [out, in] under the checkpoint's name. The model picks its fast kernel: the
lm_head takes kernels.gemv for 1-64 rows (on the 152k-row head it beats cuBLAS); on Hopper the decoder's
projections take kernels.stream_gemv for a single row (a batch-1 decode) and kernels.gemv for 2-16 rows
where its tuned table has the shape, chained under PDL with the kernels around them; a streamed row of
the packed gate_up ends in the SiLU-and-mul (folds_silu_mul). Everywhere else it is F.linear, which is also
the reference the fast paths are tested against; on the fast path a shape on which cuBLAS splits K takes
cuBLASLt's kernel for 17 rows and up (cublaslt_max_rows: down_proj and o_proj).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve_core.kernels import tuned

# kernels.gemv's MAX_ROWS and PROJECTION_MAX_ROWS, repeated so that a CPU-only install without Triton never
# imports the Triton kernels.
MAX_ROWS = 64
PROJECTION_MAX_ROWS = 16
# Where no card was tuned: on a weight with at least twice as many inputs as outputs cuBLAS's heuristic splits
# K at 17-64 rows and sums the pieces in a kernel of its own, where cuBLASLt runs one; on a square weight it
# does so at 17-48 rows (benchmarks/results/LOG.md).
CUBLASLT_MAX_ROWS = 64
SQUARE_CUBLASLT_MAX_ROWS = 48


@tuned.family("cublaslt", ("N", "K", "dtype"))
def _cublaslt_heuristic(device: tuned.Device, N: int, K: int, dtype: str) -> dict:
    if K >= 2 * N:
        return {"max_rows": CUBLASLT_MAX_ROWS}
    return {"max_rows": SQUARE_CUBLASLT_MAX_ROWS if K == N else 0}


def cublaslt_max_rows(device: tuned.Device, n: int, k: int, dtype: torch.dtype) -> int:
    """The most rows (past PROJECTION_MAX_ROWS) for which an [n, k] weight's F.linear takes cuBLASLt on the
    fast path (0: never): where cuBLAS splits K and cuBLASLt does not."""
    return tuned.lookup("cublaslt", device, N=n, K=k, dtype=tuned.dtype_key(dtype))["max_rows"]


class Linear(nn.Module):
    # Set by the model on the fast path: "gemv" (the lm_head: kernels/gemv.py for 1-64 rows) or "stream"
    # (the decoder's projections: kernels/stream_gemv.py for one row, kernels/gemv.py for 2-16 rows at a
    # tuned shape, launched under PDL when `pdl`).
    fast_kernel: str | None = None
    pdl = False
    # Set by the model on the fast path (cublaslt_max_rows): F.linear of 17 up to this many rows goes
    # through cuBLASLt.
    cublaslt_rows = 0

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, silu_mul: bool = False) -> torch.Tensor:
        """silu_mul: this is a packed [gate | up] projection of a row for which folds_silu_mul holds; the
        result is SiLU(gate) * up, computed in the stream GEMV's epilogue."""
        if silu_mul:
            assert self.folds_silu_mul(x.shape[0]) and x.stride(-1) == 1, "Linear: silu_mul off the one-row stream"
            from llmserve_core.kernels.stream_gemv import stream_gemv
            return stream_gemv(x, self.weight, out_dtype=out_dtype, pdl=self.pdl, silu_mul=True)
        if self.fast_kernel == "gemv" and 0 < x.shape[0] <= MAX_ROWS:
            from llmserve_core.kernels.gemv import gemv
            return gemv(x, self.weight, out_dtype=out_dtype)
        if self.fast_kernel == "stream" and 0 < x.shape[0] <= PROJECTION_MAX_ROWS and x.stride(-1) == 1:
            if x.shape[0] == 1:
                if self._streams():
                    from llmserve_core.kernels.stream_gemv import stream_gemv
                    return stream_gemv(x, self.weight, out_dtype=out_dtype, pdl=self.pdl)
            else:
                from llmserve_core.kernels.gemv import gemv, projection_tiles
                cfg = projection_tiles(tuned.device_spec(x.device), x.shape[0], *self.weight.shape, self.weight.dtype,
                                       x.dtype)
                if cfg is not None:
                    return gemv(x, self.weight, out_dtype=out_dtype, config=cfg, pdl=self.pdl)
        if PROJECTION_MAX_ROWS < x.shape[0] <= self.cublaslt_rows and x.is_cuda:
            y = _linear_cublaslt(x, self.weight)
        else:
            y = F.linear(x, self.weight)
        return y if out_dtype is None else y.to(out_dtype)

    def folds_silu_mul(self, rows: int) -> bool:
        """Whether forward can end `rows` rows of this packed [gate | up] weight in the SiLU-and-mul: one row
        on the stream GEMV (2-16 rows take kernels/gemv.py, which splits K)."""
        return self.fast_kernel == "stream" and rows == 1 and self._streams() and self.out_features % 2 == 0

    def _streams(self) -> bool:
        from llmserve_core.kernels.stream_gemv import MIN_BLOCK_K
        return self.in_features % MIN_BLOCK_K == 0

    def cublaslt_max_rows(self) -> int:
        """cublaslt_max_rows for this weight on its device."""
        return cublaslt_max_rows(tuned.device_spec(self.weight.device), self.out_features, self.in_features,
                                 self.weight.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


def _linear_cublaslt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear with torch's BLAS preference set to cuBLASLt for this call only. The preference is
    process-wide state read when the call is made, so a CUDA graph keeps the kernel it captured."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight)
    finally:
        torch.backends.cuda.preferred_blas_library(before)
