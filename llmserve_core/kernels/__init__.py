"""Triton kernels, each with the torch reference it is tested against in the same module.

Triton compiles only for GPUs. On a machine without CUDA the kernels run in Triton's interpreter, so the
CPU test suite exercises the very code the GPU runs; this must be decided before any kernel is decorated.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_scalar_index() -> None:
    """Let interpreted kernels use loaded scalars as loop bounds.

    Triton 3.6's interpreter keeps scalars as 1-element arrays and turns them into Python ints with
    int(array), which NumPy >= 2.4 refuses for arrays with a dimension. Only the interpreter is touched.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_llmserve_fixed", False):
        return  # another Triton layout: nothing to fix, or already fixed

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._llmserve_fixed = True
    interpreter._patch_lang_tensor = patch


def _fix_interpreter_fp8_downcast() -> None:
    """Round float -> float8_e4m3fn in interpreted kernels to nearest even, as the GPU's cvt.rn does.

    Triton 3.6's interpreter drops the carry when rounding overflows the mantissa (31.8 becomes 16, not 32),
    which would make every FP8 kernel disagree with its reference on the CPU. torch's cast rounds correctly.
    """
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None or getattr(original, "_llmserve_fixed", False):
        return
    sources = {"fp32": (np.float32, None), "fp16": (np.float16, None), "bf16": (np.int16, torch.bfloat16)}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype.name in sources:
            np_dtype, torch_view = sources[input_dtype.name]
            src = torch.from_numpy(np.frombuffer(input.tobytes(), dtype=np_dtype).copy())
            if torch_view is not None:
                src = src.view(torch_view)
            return src.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert._llmserve_fixed = True
    interpreter._convert_float = convert


def _triton_present() -> bool:
    # The torch-only modules here (references, the FP8 number format) must import where Triton is absent.
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


if os.environ.get("TRITON_INTERPRET") == "1" and _triton_present():
    _fix_interpreter_scalar_index()
    _fix_interpreter_fp8_downcast()

from llmserve_core.kernels import jit_count  # noqa: E402  (after the interpreter choice above)

jit_count.install()
